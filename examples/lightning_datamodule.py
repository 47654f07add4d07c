"""A LightningDataModule over S5Dataset + S5Sampler, with s5loader's live metrics in the logs.

Lightning is not a dependency of s5loader (``pip install lightning`` for this example); without
it the script runs the same data path, ``build_loader``, in a plain loop. Against the local
SeaweedFS, from the repository root:

    eval "$(bin/s3-local start)"                                  # endpoint, credentials, s3://demo/
    python examples/lightning_datamodule.py s3://demo/lightning/ --generate 256
    bin/s3-local stop

``--generate N`` first writes a toy data set of N ``NNNN.image`` + ``NNNN.label`` pairs under
the prefix. Pass ``use_distributed_sampler=False`` to the Trainer: S5Sampler is already a
DistributedSampler, and Lightning would replace it otherwise. Lightning calls
``sampler.set_epoch`` each epoch.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from torch.utils.data import DataLoader

from s5loader import S5Dataset, S5Sampler

try:
    import lightning as L  # noqa: N812

    HAVE_LIGHTNING = True
except ImportError:
    try:
        import pytorch_lightning as L  # type: ignore[no-redef]  # noqa: N812

        HAVE_LIGHTNING = True
    except ImportError:
        HAVE_LIGHTNING = False


def decode(sample: dict[str, Any]) -> dict[str, Any]:
    """Bytes to tensors: a real data set would decode images here."""
    image = torch.frombuffer(bytearray(sample["image"]), dtype=torch.uint8).float()
    return {"image": image[:64].mean(), "label": int(sample["label"])}


def build_loader(
    source: str,
    *,
    endpoint_url: str | None = None,
    batch_size: int = 32,
    num_workers: int = 4,
    budget: int | str = "1GiB",
    staging_dir: str | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> tuple[DataLoader, S5Sampler]:
    """The data path the DataModule uses: the loader and its sampler (close the sampler when done)."""
    dataset = S5Dataset.from_prefix(source, endpoint_url=endpoint_url, group_by="stem", transform=decode)
    sampler = S5Sampler(
        dataset, shuffle=shuffle, seed=seed, budget=budget, batch_size=batch_size, staging_dir=staging_dir
    )
    loader = DataLoader(dataset, sampler=sampler, batch_size=batch_size, num_workers=num_workers)
    return loader, sampler


if HAVE_LIGHTNING:

    class S5DataModule(L.LightningDataModule):
        """Training data from S3 through s5loader; ``self.sampler.metrics()`` while it runs."""

        def __init__(
            self,
            source: str,
            *,
            endpoint_url: str | None = None,
            batch_size: int = 32,
            num_workers: int = 4,
            budget: int | str = "1GiB",
            staging_dir: str | None = None,
        ) -> None:
            super().__init__()
            self.source, self.endpoint_url = source, endpoint_url
            self.batch_size, self.num_workers, self.budget, self.staging_dir = (
                batch_size,
                num_workers,
                budget,
                staging_dir,
            )
            self.sampler: S5Sampler | None = None

        def train_dataloader(self) -> DataLoader:
            loader, self.sampler = build_loader(
                self.source,
                endpoint_url=self.endpoint_url,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                budget=self.budget,
                staging_dir=self.staging_dir,
            )
            return loader

        def teardown(self, stage: str) -> None:
            if self.sampler is not None:
                self.sampler.close()

    class TinyModel(L.LightningModule):
        """A linear model on one number per image; it logs the loader's metrics each step."""

        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(1, 10)

        def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.cross_entropy(
                self.linear(batch["image"].float()[:, None] / 255), batch["label"]
            )
            sampler = self.trainer.datamodule.sampler
            if sampler is not None:
                m = sampler.metrics()
                self.log_dict({"mb_s": m.mb_s, "ready_ahead": float(m.ready_ahead)}, prog_bar=True)
                self.log_dict({f"s5loader/{k}": float(v) for k, v in m.as_dict().items()})
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)


def generate(source: str, n: int, endpoint_url: str | None) -> None:
    import boto3

    bucket, _, prefix = source.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=endpoint_url)
    for i in range(n):
        s3.put_object(Bucket=bucket, Key=f"{prefix}{i:04d}.image", Body=bytes([i % 256]) * 4096)
        s3.put_object(Bucket=bucket, Key=f"{prefix}{i:04d}.label", Body=str(i % 10).encode())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="s3://bucket/prefix/ of NNNN.image + NNNN.label pairs")
    p.add_argument("--generate", type=int, default=0, metavar="N", help="first write N toy pairs there")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--endpoint-url", default=os.environ.get("AWS_ENDPOINT_URL_S3"))
    args = p.parse_args()
    if args.generate:
        generate(args.source, args.generate, args.endpoint_url)
    if HAVE_LIGHTNING:
        dm = S5DataModule(args.source, endpoint_url=args.endpoint_url, batch_size=16)
        trainer = L.Trainer(
            max_epochs=args.epochs, use_distributed_sampler=False, accelerator="cpu", logger=False
        )
        trainer.fit(TinyModel(), datamodule=dm)
        return
    loader, sampler = build_loader(args.source, endpoint_url=args.endpoint_url, batch_size=16)
    with sampler:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for step, _batch in enumerate(loader):
                if step % 10 == 0:
                    print(f"epoch {epoch} step {step}: {sampler.metrics()}")


if __name__ == "__main__":
    main()
