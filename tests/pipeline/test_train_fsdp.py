"""FSDP training (Lightning's FSDPStrategy needs CUDA: `pytest -m gpu` on a GPU box; on a CPU the option is refused in
one line before any compute): it starts, checkpoints, and a resumed run continues with the losses of an uninterrupted
one, to an export the runtime loads."""

import pytest

from specdraft.errors import SpecdraftError
from specdraft.pipeline.train import train_drafter
from specdraft.runtime.drafter_io import load_drafter
from specdraft.runtime.load import load_target
from tests.helpers import requires_cuda
from tests.pipeline.test_train import RecordingTracker, StopAt, _cfg, _prepare

pytestmark = pytest.mark.integration  # `make test-fast` leaves it out


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU refusal (a CUDA box runs FSDP itself)")
def test_fsdp_on_a_cpu_is_one_clear_line_before_compute(tiny_world, tmp_path):
    data = _prepare(tiny_world, tmp_path / "w")
    with pytest.raises(SpecdraftError, match="'train.strategy'.*CUDA"):
        train_drafter(_cfg(tiny_world, tmp_path / "w", "train.strategy=fsdp"), tiny_world, data, RecordingTracker(),
                      log=lambda m: None)
    assert not (tmp_path / "w" / "checkpoints").exists()


@pytest.mark.gpu
@requires_cuda
def test_fsdp_starts_checkpoints_and_resumes_with_the_same_losses(tiny_world, tmp_path):
    extra = ("train.strategy=fsdp", "train.devices=1", "target.device=cuda")  # one GPU: what a lent box has
    full = RecordingTracker()
    data = _prepare(tiny_world, tmp_path / "a")
    train_drafter(_cfg(tiny_world, tmp_path / "a", *extra), tiny_world, data, full, log=lambda m: None)
    data = _prepare(tiny_world, tmp_path / "b")
    first = RecordingTracker()
    train_drafter(_cfg(tiny_world, tmp_path / "b", *extra), tiny_world, data, first, log=lambda m: None,
                  callbacks=[StopAt(3)])
    assert max(first.metrics["train/loss"]) == 3 and list((tmp_path / "b" / "checkpoints").rglob("*.ckpt"))
    second = RecordingTracker()
    train_drafter(_cfg(tiny_world, tmp_path / "b", *extra), tiny_world, data, second, log=lambda m: None)
    assert sorted(second.metrics["train/loss"]) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second.metrics["train/loss"][step] == pytest.approx(full.metrics["train/loss"][step], rel=1e-4)
    target = load_target(tiny_world.target_dir)
    drafter = load_drafter(tmp_path / "b" / "drafter" / "sft", target)
    assert drafter.block_size == 4
