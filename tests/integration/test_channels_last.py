"""A convnet in channels_last (`model.to(memory_format=torch.channels_last)`, torchvision's recipe for speed) trains
through the pipeline exactly as in one process. Its activations and their gradients used to cross each boundary
row-major, so the next stage's convolutions ran other kernels: 1.2e-7 apart after one step, 0.25 after four (resnet18
with momentum). The wire now keeps every dense layout (wire/structure.wire_stride); parameters and buffers equal the
single-process reference on 2 processes: resnet18 under 1F1B and under zbv (two stages per rank: a local hand-off
too), timm's EfficientNet-B0 under zbh1 (the backward split into input and weight gradients)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from model_parallel.runtime.launch import free_port, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

_WORKER = r'''
import copy, sys
import model_parallel  # noqa: F401  (the torchvision repair, before timm imports it)
from datetime import timedelta
import torch, torch.nn.functional as F
import torch.distributed as dist
from model_parallel import PipelineTrainer, RunOptions, TrainConfig, import_torchvision
from model_parallel.runtime.data.batches import SyntheticData
from model_parallel.runtime.trainer import single_process_reference

torch.set_num_threads(1)
rank, port, schedule, arch, size = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
torch.manual_seed(0)
if arch == "resnet18":
    model = import_torchvision().models.resnet18(num_classes=10)
else:  # timm's EfficientNet: depthwise convolutions, squeeze-excite, BatchNormAct
    import timm
    model = timm.create_model(arch, pretrained=False, num_classes=10)
model = model.to(memory_format=torch.channels_last)
reference = copy.deepcopy(model)
images = SyntheticData(batch_size=8, shape=(3, size, size), num_classes=10)

class ChannelsLast:
    """The images in channels_last too, as the recipe feeds them."""
    def batch(self, step):
        inputs, labels = images.batch(step)
        return tuple(x.contiguous(memory_format=torch.channels_last) for x in inputs), labels

config = TrainConfig(batch_size=8, num_microbatches=2, schedule=schedule)
sgd = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
with PipelineTrainer(model, sgd, ChannelsLast(), config, options=RunOptions(progress=False, timeout=60),
                     criterion=F.cross_entropy) as trainer:
    losses = [r.loss for r in trainer.train(4)]
    state = trainer.state_dict(original_names=True)
if rank == 0:
    want = single_process_reference(reference, F.cross_entropy, sgd, ChannelsLast(), config, 4)
    assert max(abs(a - b) for a, b in zip(losses, want)) < 1e-5, (losses, want)
    expected = reference.state_dict()
    worst = max((float((state[k].double() - v.double()).abs().max()), k) for k, v in expected.items() if v.is_floating_point())
    assert set(state) == set(expected) and worst[0] < 1e-5, worst
    print(f"{schedule}: {len(expected)} tensors, largest difference {worst[0]:.3g} ({worst[1]})", flush=True)
dist.destroy_process_group()
'''


# EfficientNet at 64x64: at 32x32 its last blocks are 1x1, and a cut there crosses (N, C, 1, 1) tensors whose strides
# are ambiguous (channels_last and row-major at once); see docs/runtime.md, "Memory layouts cross with the values".
@pytest.mark.parametrize("arch, schedule, size", [("resnet18", "1f1b", 32), ("resnet18", "zbv", 32),
                                                  ("efficientnet_b0", "zbh1", 64)])
def test_a_channels_last_convnet_trains_exactly_on_two_processes(tmp_path: Path, arch: str, schedule: str,
                                                                 size: int) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = free_port()
    result = launch([[sys.executable, str(script), str(rank), str(port), schedule, arch, str(size)] for rank in range(2)],
                    timeout=240)
    assert result.ok, result.summary()
    assert f"{schedule}: " in result.workers[0].output, result.workers[0].output[-2000:]
