"""OmniCoordinator package (replica liveness and load balancing); see issue 3."""
