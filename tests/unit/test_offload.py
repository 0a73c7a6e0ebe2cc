"""parallel.cpu_offload in one process: FSDP2 on a 1-rank mesh keeps the weights, gradients and AdamW state on the
host (PyTorch's fused CPU AdamW steps them), and the run's losses equal the same run without offload; a checkpoint
resumes across offload and no offload as if the run had not stopped; the backend choice and the config rules; the
planner's model of single-GPU offload and its search, which offers offload where nothing else fits."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from loom.checkpoint.manager import step_dir_name
from loom.config.errors import ConfigError
from loom.methods import resolve
from loom.plan.hardware import GPUS
from loom.plan.memory import GIB
from loom.plan.planner import HOST_GIB_PER_GPU, estimate, host_step_s, offload_bytes, search
from loom.runtime.env import choose_backend
from loom.train.trainer import Trainer
from tests.tiny import tiny_config

STEPS = 4
BASE = {"run.seed": 7, "training.steps": STEPS, "training.micro_batch_size": 2, "optimizer.lr": 3e-3}
OFFLOAD = {"parallel.cpu_offload": "true"}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """The 1-rank process group an offloaded trainer makes for itself goes with this module (a later test may make
    its own group)."""
    had = dist.is_initialized()
    yield
    if not had and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


def train(run_dir, cache, **extra) -> tuple[Trainer, list[dict]]:
    trainer = Trainer(tiny_config(run_dir, cache, **{**BASE, **extra}))
    return trainer, trainer.fit()


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def plain(tmp_path_factory, cache) -> list[dict]:
    return train(tmp_path_factory.mktemp("plain"), cache)[1]


def test_one_process_offload_equals_the_run_without_it(tmp_path, cache, plain):
    from torch.distributed.fsdp import FSDPModule

    trainer, records = train(tmp_path, cache, **OFFLOAD)
    part = trainer.parts[0]
    assert isinstance(part, FSDPModule) and all(isinstance(b, FSDPModule) for b in part.layers.values())
    assert part.layers["0"].attention.wq.weight.device_mesh.size() == 1  # a 1-rank mesh: nothing sharded
    assert all(p.device.type == "cpu" for p in trainer.params)
    states = [
        t for s in trainer.optimizer.optimizers[0].state.values() for t in s.values() if torch.is_tensor(t)
    ]
    assert states and all(t.device.type == "cpu" for t in states)
    assert trainer.optimizer.optimizers[0].defaults["fused"]  # PyTorch's fused CPU kernel, not foreach
    assert max(r["grad_norm"] for r in records) > BASE.get("training.max_norm", 1.0)  # clipping took part
    assert max_rel([r["loss"] for r in records], [r["loss"] for r in plain]) < 1e-6
    assert max_rel([r["grad_norm"] for r in records], [r["grad_norm"] for r in plain]) < 1e-5


@pytest.mark.parametrize("saved,resumed", [(OFFLOAD, {}), pytest.param({}, OFFLOAD, marks=pytest.mark.slow)])
def test_a_checkpoint_resumes_across_offload(tmp_path, cache, plain, saved, resumed):
    """Saved at step 2 with (without) offload, resumed without (with) it: steps 3 and 4 as the uninterrupted run's."""
    every = {"checkpoint.every": 2}
    train(tmp_path, cache, **saved, **every)
    shutil.rmtree(os.path.join(tmp_path, "checkpoints", step_dir_name(STEPS)))  # the run stopped after step 2
    trainer, records = train(tmp_path, cache, **resumed, **every)
    assert [r["step"] for r in records] == [3, 4]
    assert max_rel([r["loss"] for r in records], [r["loss"] for r in plain[2:]]) < 1e-6


def test_backend_choice():
    assert choose_backend("auto", "cuda", cpu_offload=True) == "cuda:nccl,cpu:gloo"
    assert choose_backend("auto", "cuda") == "nccl"
    assert choose_backend("auto", "cpu", cpu_offload=True) == "gloo"
    assert choose_backend("gloo", "cuda", cpu_offload=True) == "gloo"
    with pytest.raises(ConfigError, match="nccl needs CUDA devices"):
        choose_backend("nccl", "cpu")


@pytest.mark.parametrize(
    "over,world,field,words",
    [
        ({"parallel.backend": "nccl"}, 1, "parallel.backend", "NCCL cannot reduce"),
        ({"parallel.dp_replicate": 2}, 2, "parallel.cpu_offload", "shard over those ranks instead"),
        ({"parallel.tp": 2}, 2, "parallel.cpu_offload", "tp = pp = 1"),
        ({"training.objective": "grpo"}, 1, "parallel.cpu_offload", "grpo"),
    ],
)
def test_layouts_offload_cannot_run_are_config_errors(over, world, field, words):
    with pytest.raises(ConfigError, match=words) as err:
        resolve(tiny_config(**OFFLOAD, **over), world)
    assert err.value.field == field


# ---- the planner -----------------------------------------------------------------------------


def plan_config(**over):
    return tiny_config(
        **{
            "model.flavor": "8B",
            "training.seq_len": 512,
            "training.dtype": "bfloat16",
            "training.global_batch_size": 8,
            "training.micro_batch_size": 8,
            "training.activation_checkpointing": "full",
            **over,
        }
    )


def test_plan_of_one_gpu_offload_moves_the_state_to_the_host():
    """The 8B shape on one H100: the state (16 bytes a parameter) does not fit the GPU, offloaded it is in host memory
    and the GPU keeps the gathered blocks and activations; the step pays the PCIe copies and the host's AdamW."""
    gpu = GPUS["H100"]
    on_gpu = estimate(plan_config(), 1, gpu)
    off = estimate(plan_config(**OFFLOAD), 1, gpu)
    params = on_gpu.memory.weights / 4
    assert not on_gpu.fits and off.fits
    assert off.memory.weights == off.memory.gradients == off.memory.optimizer == 0
    assert off.host_gib == pytest.approx(16 * params / GIB) and off.host_gib < HOST_GIB_PER_GPU
    assert off.memory.total < 0.25 * on_gpu.memory.total
    assert off.layout["cpu_offload"] and "cpu_offload" in off.describe()
    root = 2 * 128256 * 4096 + 4096  # embeddings, head, final norm: gathered once a micro-batch
    h2d, d2h = offload_bytes(params, root, off_inputs := _inputs(plan_config(**OFFLOAD)))
    assert off_inputs.reshard_after_forward  # the blocks in twice (forward, backward), the gradients out once
    assert (h2d, d2h) == (8 * (params - root) + 4 * root, 4 * params)
    assert off.time.optimizer == pytest.approx(host_step_s(params, 1))
    assert off.time.fsdp >= h2d / 50e9  # one rank: the copies in are not hidden behind compute
    assert off.time.total > on_gpu.time.total  # slower: the price of fitting
    assert any("host memory" in n and "GB/s" in n for n in off.notes)


def _inputs(cfg):
    from loom.plan.planner import memory_inputs, validate

    dims, args, _ = validate(cfg, 1)
    return memory_inputs(cfg, dims, args)


def test_search_offers_offload_where_nothing_else_fits():
    """The 1B shape (20 GB of state) on a GPU of 12 GiB: no layout fits with the state on the GPU, so the search's
    answers are offloaded; on an H100, where layouts fit, offload is not searched."""
    cfg = plan_config(
        **{
            "model.flavor": "1B",
            "training.seq_len": 256,
            "training.global_batch_size": 1,
            "training.micro_batch_size": 1,
        }
    )
    best, valid = search(cfg, 1, replace(GPUS["H100"], memory_gib=12.0), top=3, margin_gib=0.0)
    assert best and all(e.layout["cpu_offload"] and e.fits for e in best) and valid >= len(best)
    roomy, _ = search(cfg, 1, GPUS["H100"], top=3)
    assert roomy and not any(e.layout["cpu_offload"] for e in roomy)


def test_train_precheck_weighs_the_offloaded_state_against_the_host(monkeypatch):
    """``loom train``'s memory check: the 1B recipe's state (at its lightest step) does not fit a GPU that its
    offloaded step fits (the refusal suggests offload); offloaded, the GPU holds the step and the host the state
    (refused when the host is too small). GPU and host memory are monkeypatched, as in test_fit."""
    import loom.plan.fit as fit
    from loom.config import build_config
    from loom.data import build_tokenizer
    from loom.plan.planner import rank_needs

    recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "llama3_1b.toml")
    light = {
        "run.device": "auto",
        "training.micro_batch_size": "1",
        "training.activation_checkpointing": "full",
    }
    plain, off = (build_config(recipe, {**light, **o}) for o in ({}, OFFLOAD))
    run = resolve(off, 1).with_model(build_tokenizer(off.data.tokenizer))
    step = rank_needs(off, run.dims, run.model_args, "cuda")
    state = rank_needs(plain, run.dims, run.model_args, "cuda", peak=False).state_bytes
    assert step.state_bytes == 0 and step.host_bytes == state > 1.5 * step.peak_bytes
    monkeypatch.setattr(fit, "gpu_room", lambda count, own: (1.05 * step.peak_bytes, "test GPU memory"))
    monkeypatch.setattr(fit, "host_room", lambda: (4 * state, "test host memory"))
    with pytest.raises(ConfigError, match=r"or parallel.cpu_offload true \(the state in host memory\)"):
        fit.check_fits(plain, run.dims, run.model_args, "cuda", 1)
    fit.check_fits(off, run.dims, run.model_args, "cuda", 1)
    monkeypatch.setattr(fit, "host_room", lambda: (0.5 * state, "test host memory"))
    with pytest.raises(ConfigError, match=r"test host memory"):
        fit.check_fits(off, run.dims, run.model_args, "cuda", 1)


# ---- activation offload (training.activation_offload) ------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({str(i): _Block() for i in range(3)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return x.square().mean()


@pytest.mark.parametrize("ac", ["none", "full", "op", "matmuls"])
def test_activation_offload_packs_through_host_copies_with_the_same_gradients(ac):
    """Every saved tensor of an offloaded block (not its weights) goes through the hooks and comes back with the
    same gradients; a recomputed block (full or op checkpointing) offloads its input only, the rule documented."""
    from loom.parallel.activation_checkpoint import apply_activation_checkpointing
    from loom.parallel.activation_offload import apply_activation_offload

    torch.manual_seed(0)
    model, x = _Stack(), torch.randn(4, 8, 16)
    apply_activation_checkpointing(model.layers, ac, 1)
    model(x).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    offload = apply_activation_offload(model, "0,2", torch.device("cpu"))
    model(x).backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))
    block_input = x.numel() * 4
    if ac == "none":  # the input, the normalized input, the linear's output (and more): never a weight
        assert offload.packed_bytes > 2 * 2 * block_input
    else:
        assert offload.packed_bytes == 2 * block_input
    packed = offload.packed_bytes
    with torch.no_grad():
        model(x)  # nothing is saved without gradients
    assert offload.packed_bytes == packed


class _Fork(torch.nn.Module):
    """Two linears reading one tensor (as q, k and v do; gate and up): autograd saves it twice, as a 2-D view; a
    sine saves it once more in its own shape."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = x * 2  # a multiply by a number saves nothing
        return self.a(h) * 0.5 + self.b(h) + torch.sin(h)


def test_activation_offload_copies_a_tensor_saved_twice_once():
    """The view both linears save goes to the host once, the sine's view once more (two copies' bytes, one storage
    kept alive without offload), and every backward read gets it back."""
    from loom.parallel.activation_offload import apply_activation_offload

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(), torch.randn(4, 8, 16, requires_grad=True)
    model.layers = torch.nn.ModuleDict({"0": _Fork()})
    model.forward = lambda t: model.layers["0"](t).square().sum()
    want = torch.autograd.grad(model(x), [x, *model.parameters()])
    offload = apply_activation_offload(model, "all", torch.device("cpu"))
    got = torch.autograd.grad(model(x), [x, *model.parameters()])
    assert offload.packed_bytes == 2 * offload.resident_bytes == 2 * x.numel() * 4
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_activation_offload_run_equals_the_run_without_it(tmp_path, cache, plain):
    """A tiny run offloading both blocks, one of them recomputed (every_k), gives the same losses, bit for bit."""
    trainer, records = train(
        tmp_path,
        cache,
        **{
            "training.activation_offload": "all",
            "training.activation_checkpointing": "every_k",
            "training.ac_every": 2,
        },
    )
    assert trainer.parts[0].activation_offload.packed_bytes > 0
    assert [r["loss"] for r in records] == [r["loss"] for r in plain]


@pytest.mark.parametrize(
    "over,field,words",
    [
        (
            {"training.activation_offload": "0,x"},
            "training.activation_offload",
            "a comma list of block indices",
        ),
        ({"training.activation_offload": "1,1"}, "training.activation_offload", "each once"),
        (
            {"training.activation_offload": "all", "training.compile": "true"},
            "training.activation_offload",
            "compile",
        ),
        ({"optimizer.offload": "nvme", "optimizer.name": "lamb"}, "optimizer.offload", "use adamw"),
        ({"optimizer.offload_path": "/x"}, "optimizer.offload_path", "does nothing without"),
    ],
)
def test_offload_fields_that_cannot_run_are_config_errors(over, field, words):
    with pytest.raises(ConfigError, match=words) as err:
        resolve(tiny_config(**over), 1)
    assert err.value.field == field


def test_activation_offload_block_beyond_the_model_is_a_config_error():
    from loom.parallel.activation_offload import apply_activation_offload

    with pytest.raises(ConfigError, match=r"0\.\.2") as err:
        apply_activation_offload(_Stack(), "3", torch.device("cpu"))
    assert err.value.field == "training.activation_offload"


# ---- NVMe offload of the optimizer state (optimizer.offload nvme) -------------------------------------------------

NVME = {
    "optimizer.offload": "nvme",
    "optimizer.offload_chunk_mb": 0.01,
}  # chunks of 2,621 elements: many a step


def test_nvme_offload_equals_the_run_without_it_and_resumes(tmp_path, cache, plain):
    """The moments in files of a folder of loom's own in optimizer.offload_path, stepped in chunks: the losses equal
    the run without offload bit for bit; the checkpoint at step 2 (DCP reads the file-backed moments) resumes steps
    3 and 4 as the uninterrupted run's; at the end loom's folder is gone and a file of the user's there stays."""
    from loom.train.nvme_offload import NvmeAdamW

    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "mine.bin").write_bytes(b"keep")
    run = tmp_path / "run"
    every = {"checkpoint.every": 2, "optimizer.offload_path": str(disk), **NVME}
    trainer, records = train(run, cache, **every)
    opt = trainer.optimizer.optimizers[0]
    assert isinstance(opt, NvmeAdamW) and opt._files
    in_state = {s["exp_avg"].data_ptr() for s in opt.state.values()}
    assert all(
        m.data_ptr() in in_state for m, _ in opt._files.values()
    )  # the moments are the file-backed tensors
    assert max(p.numel() for p in trainer.params) > opt.chunk
    assert [r["loss"] for r in records] == [r["loss"] for r in plain]
    assert sorted(os.listdir(disk)) == ["mine.bin"] and (disk / "mine.bin").read_bytes() == b"keep"
    shutil.rmtree(os.path.join(run, "checkpoints", step_dir_name(STEPS)))  # the run stopped after step 2
    trainer, records = train(run, cache, **every)
    assert [r["step"] for r in records] == [3, 4]
    assert [r["loss"] for r in records] == [r["loss"] for r in plain[2:]]
    assert sorted(os.listdir(disk)) == ["mine.bin"]


def test_nvme_offload_folder_refuses_a_path_without_room_or_write_access(tmp_path, monkeypatch):
    import loom.train.nvme_offload as nvme

    with pytest.raises(ConfigError, match="is not a folder") as err:
        nvme.StateFolder(str(tmp_path / "missing"), 1)
    assert err.value.field == "optimizer.offload_path"
    monkeypatch.setattr(
        nvme.os, "access", lambda path, mode: False
    )  # root writes anywhere: the check is patched
    with pytest.raises(ConfigError, match="is not writable"):
        nvme.StateFolder(str(tmp_path), 1)
    monkeypatch.undo()
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(ConfigError, match="GiB free and this rank's AdamW moments need"):
        nvme.StateFolder(str(tmp_path), free + 2**40)
    folder = nvme.StateFolder(str(tmp_path), 8)
    state = folder.tensor("exp_avg", 5)
    state += 1
    assert os.path.getsize(folder.files[0]) == 20 and os.path.basename(folder.path).startswith(nvme.PREFIX)
    (tmp_path / "other").write_text("x")
    folder.close()
    assert sorted(os.listdir(tmp_path)) == ["other"] and state.sum() == 5  # the mapped values stay readable


def test_plan_models_activation_offload_and_nvme_offload():
    """Activation offload: the offloaded blocks' saved tensors leave the GPU but for two blocks in flight, wait on
    the host, and cost their PCIe copies where compute does not hide them. NVMe offload: the moments (8 bytes a
    parameter) leave the GPU (or, with cpu_offload, the host) for the disk, and the step waits for their file IO."""
    from loom.plan.planner import nvme_step_s

    gpu, traced = GPUS["H100"], {}  # the activation traces shared
    light = {**OFFLOAD, "model.n_layers": 8, "training.activation_checkpointing": "none"}
    base = estimate(plan_config(**light), 1, gpu, traced)
    off = estimate(plan_config(**light, **{"training.activation_offload": "all"}), 1, gpu, traced)
    per_block = (off.host_gib - base.host_gib) * GIB / 8
    assert per_block > 0 and base.time.offload == 0 < off.time.offload
    assert base.memory.activations - off.memory.activations == pytest.approx(6 * per_block)
    assert "act_offload8" in off.describe() and any("activation_offload: 8 blocks" in n for n in off.notes)
    # op-level checkpointing: a block parks its input alone (bf16 here: cpu_offload's FSDP2 computes in it; fp32
    # under autocast); what the policy keeps stays on the device
    lora = {
        "model.n_layers": 8,
        "lora.rank": 4,
        "lora.base_dtype": "bfloat16",
    }  # its frozen embedding in bf16
    for ac in ("op", "matmuls"):
        for over, width in (({**light}, 2), ({"model.n_layers": 8}, 4), (lora, 2)):
            over["training.activation_checkpointing"] = ac
            kept, parked = (
                estimate(plan_config(**over, **extra), 1, gpu, traced)
                for extra in ({}, {"training.activation_offload": "all"})
            )
            assert (parked.host_gib - kept.host_gib) * GIB / 8 == pytest.approx(8 * 512 * 4096 * width), (
                ac,
                width,
            )
    on_gpu, nvme = (estimate(plan_config(**o), 1, gpu, traced) for o in ({}, {"optimizer.offload": "nvme"}))
    params = on_gpu.memory.weights / 4
    assert nvme.memory.optimizer == 0 and nvme.disk_gib == pytest.approx(8 * params / GIB)
    assert nvme.memory.weights == on_gpu.memory.weights and nvme.time.optimizer == pytest.approx(
        nvme_step_s(params)
    )
    both = estimate(plan_config(**OFFLOAD, **{"optimizer.offload": "nvme"}), 1, gpu, traced)
    assert both.host_gib == pytest.approx(8 * params / GIB) and "nvme" in both.describe()


def test_nvme_adamw_steps_like_adamw_and_loads_its_state_into_files(tmp_path):
    """Chunks that do not divide the tensors (7 elements) give PyTorch's AdamW's parameters bit for bit over steps;
    a plain AdamW's state dict (a run saved without offload) loads into the files and steps on identically."""
    from loom.train.nvme_offload import NvmeAdamW, StateFolder

    torch.manual_seed(0)
    hyper = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

    def make():
        torch.manual_seed(1)
        return [torch.nn.Parameter(torch.randn(5, 9)), torch.nn.Parameter(torch.randn(4))]

    def step(params, opt, seed):
        torch.manual_seed(seed)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()

    ref_params, nvme_params = make(), make()
    ref = torch.optim.AdamW(ref_params, foreach=True, **hyper)
    nvme = NvmeAdamW(nvme_params, StateFolder(str(tmp_path), 8 * 49), 7, "foreach", **hyper)
    for seed in range(3):
        step(ref_params, ref, seed)
        step(nvme_params, nvme, seed)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, nvme_params))
    loaded = NvmeAdamW(nvme_params, StateFolder(str(tmp_path), 8 * 49), 7, "foreach", **hyper)
    loaded.load_state_dict(ref.state_dict())
    files = {m.data_ptr() for m, _ in loaded._files.values()}
    assert {s["exp_avg"].data_ptr() for s in loaded.state.values()} == files
    step(ref_params, ref, 9)
    step(nvme_params, loaded, 9)
    assert all(torch.equal(a, b) for a, b in zip(ref_params, nvme_params))
    for opt in (nvme, loaded):
        opt.close()
    assert os.listdir(tmp_path) == []
