"""The control plane's wire toolkit, shared by the coordinator, the omni master
and the replica task channel: the protocol version, bounded msgspec decoding
with counted rejects (:mod:`.codec`), HMAC signing under the cluster token
(:mod:`.auth`) and ZMQ socket helpers (:mod:`.sockets`)."""

#: Version of every control-plane message schema (coordinator, master, task
#: channel); a frame of another version is rejected as ``bad_version``.
PROTOCOL_VERSION = 1
