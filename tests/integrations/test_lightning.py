"""fastmuon.Muon from a LightningModule's configure_optimizers: trains, checkpoints, resumes."""

import pytest
import torch
from integration_support import import_offline
from torch import nn

import fastmuon


@pytest.fixture(scope="module")
def pl(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        yield import_offline(mp, "lightning.pytorch", str(tmp_path_factory.mktemp("hf_home")))


def make_module(pl):
    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU())
            self.head = nn.Linear(32, 1)

        def forward(self, x):
            return self.head(self.body(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):
            opt = fastmuon.Muon(fastmuon.param_groups(self), lr=0.05, weight_decay=0.01, adamw_lr=3e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(96, 8, generator=gen)
            y = x[:, :1] * 2 - x[:, 1:2]
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)

    return Regressor()


def fit(pl, root, epochs, ckpt_path=None):
    module = make_module(pl)
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, module


def test_configure_optimizers_returns_muon_and_resume_continues_exactly(pl, tmp_path):
    x, y = next(iter(make_module(pl).train_dataloader()))
    start = nn.functional.mse_loss(make_module(pl)(x), y).item()
    trainer, module = fit(pl, tmp_path / "straight", epochs=2)
    (opt,) = trainer.optimizers
    assert isinstance(opt, fastmuon.Muon) and opt.plan().num_matrices == 2  # the head is AdamW's
    assert [g["param_names"] for g in opt.param_groups][:2] == [
        ["body.0.weight", "body.2.weight"],
        ["head.weight"],
    ]
    assert nn.functional.mse_loss(module(x), y).item() < 0.75 * start

    half, _ = fit(pl, tmp_path / "half", epochs=1)
    ckpt = tmp_path / "epoch1.ckpt"
    half.save_checkpoint(ckpt)
    resumed, resumed_module = fit(pl, tmp_path / "resumed", epochs=2, ckpt_path=str(ckpt))
    assert resumed.global_step == trainer.global_step == 12
    for a, b in zip(module.parameters(), resumed_module.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
