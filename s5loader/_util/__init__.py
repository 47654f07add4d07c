"""Small helpers every layer may use, importing nothing of the package but its exceptions:
:mod:`.uri` (s3 URIs, sizes, the endpoint hint), :mod:`.args` (argparse types and a parser that
names a mistyped option), :mod:`.dist` (rank, world size, DataLoader worker) and
:mod:`.platform` (what s5loader needs from Linux), :mod:`.checks` (the option checks the front
ends share) and :mod:`.botoclient` (boto3 clients built from one parsed S3 model)."""
