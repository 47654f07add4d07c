# Everything a fresh machine needs is installed here: `make demo`, `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv peers-venv demo test test-fast lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# The CPU build of PyTorch first: a bare `torch` requirement would fetch a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: venv
	$(PY) bin/demo

# Everything: the unit tier and the real-path tiers (the real s5cmd against moto and SeaweedFS),
# in three processes (each with servers of its own), a test file to a process: most tests wait on
# servers and subprocesses, so three keep two cores busy (about 7.5 min against 9-10 with two).
test: venv
	$(PY) -m pytest -q -n 3 --dist loadfile tests

# The unit tier alone: no server, no subprocess; under a minute.
test-fast: venv
	$(PY) -m pytest -q tests/unit

# ruff's rules (lines of at most 110 columns included), its format and mypy; CI runs it first.
lint: venv
	$(VENV)/bin/ruff check s5loader tests bench bin examples
	$(VENV)/bin/ruff format --check s5loader tests bench bin examples
	$(VENV)/bin/mypy s5loader bench/s5loader_bench bench/run.py

# litdata and MosaicML streaming side by side with s5loader (bench/peers.py) run in a virtual
# environment of their own: they need a botocore and a numpy other than s5loader's, and MosaicML
# imports torchvision, whose PyPI wheel matches PyPI's torch build (a few GB), not a CPU wheel
# that a machine's pip settings may supply; so pip runs with its own defaults (--isolated; set
# PEERS_PIP_FLAGS= to use the machine's settings).
PEERS_VENV ?= .venv-peers
PEERS_PIP_FLAGS ?= --isolated
PEERS_STAMP := $(PEERS_VENV)/.installed

$(PEERS_STAMP):
	python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install $(PEERS_PIP_FLAGS) -q torch==2.13.0 torchvision==0.28.0 \
		litdata==0.2.76 s3fs mosaicml-streaming==0.13.0 boto3 psutil
	touch $(PEERS_STAMP)

peers-venv: $(PEERS_STAMP)

# The bench extra (matplotlib, s3torchconnector, litdata) on top of the test one, PyTorch held at
# the CPU build (litdata would otherwise pull a CUDA build); a peer that cannot be installed here
# is skipped in the tables, with the reason.
bench: venv
	$(PIP) install -q -e '.[bench]' torch==2.13.0 || true
	$(MAKE) peers-venv || true
	# s5loader, litdata and MosaicML streaming on the same 3,000 objects of 100 KB and their shards
	$(PY) bench/peers.py --peers-python $(PEERS_VENV)/bin/python --out bench/results/peers.json
	$(PY) bench/run.py
	$(PY) bench/checkpoint.py --repeat 5
	$(PY) bench/shard_mixing.py --json bench/results/shard-mixing.json
	# 6 tar shards of 100 MB: WebDataset, the sampler and the iterable, direct and through the proxy
	$(PY) bench/run.py --samples 6000 --shard-samples 1000 --out bench/results/shards-100mb --only direct proxy \
		--methods webdataset s5loader-shards s5loader-iterable
	# the epoch cache over tar shards through the proxy: a cache of half the data set, then all of it
	$(PY) bench/epoch_cache.py --shards 12 --out bench/results/epoch-cache-shards.json
	# new TCP connections per request at each s5cmd_workers, 100 KB and 20 KB objects, through the proxy
	$(PY) bench/connections.py --sample-size 100KB --workers 256 64 16
	$(PY) bench/connections.py --sample-size 20KB --workers 256 64 32 16
	# converting to shards, with and without a per-sample transform, against litdata
	$(PY) bench/pack.py --methods s5loader,litdata,s5loader+transform,litdata+transform --repeat 3 \
		--output bench/results/pack-transform.json

clean:
	rm -rf $(VENV) $(PEERS_VENV) .s3-local .pytest_cache
