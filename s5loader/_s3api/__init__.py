"""Reaching S3 with boto3, beside s5cmd (HEADs, direct GETs, small uploads, multipart clean-up):
:mod:`.client` (one client per process and per :class:`~s5loader.config.Access`) and
:mod:`.errors` (botocore's exceptions mapped to s5loader's, each naming its URI). The client
itself is made by :meth:`Access.boto3_client <s5loader.config.Access.boto3_client>`."""
