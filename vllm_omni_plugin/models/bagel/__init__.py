"""BAGEL (ByteDance-Seed): an autoregressive understanding model (Qwen2 mixture-of-
transformers with a SigLIP encoder) and a flow-matching image generator over FLUX-VAE
latents. See ``docs/design/bagel-plan.md``."""
