"""``loom doctor``: the arguments, the local workers for ``--nproc-per-node`` (PyTorch's elastic launcher, as
``loom train`` starts them) and the output; the checks are loom.cluster.doctor."""

from __future__ import annotations

import os
import sys

from loom.config.errors import ConfigError

USAGE = """usage: loom doctor [--nproc-per-node N] [--json FILE] [--local] [--sizes LIST] [--iters N]
                   [--matmul-size N] [--slow-fraction F] [--min-busbw GBPS] [--timeout SECONDS]

Checks and explains the environment a job would run in, as OK / WARN / FAIL / SKIP lines with a reason each:
Python, torch, CUDA and NCCL versions; GPUs and driver (NVML, else nvidia-smi); topology (nvidia-smi topo -m);
InfiniBand / RoCE ports; network interfaces; the NCCL_* / GLOO_* / TORCH_* / CUDA_VISIBLE_DEVICES variables set,
what each does and risky values. Across a job's ranks (--nproc-per-node N here, or under torchrun / srun:
`torchrun --nproc-per-node N -m loom doctor`, `srun python -m loom doctor`): an all-reduce and an all-gather
bandwidth test (algbw and busbw as nccl-tests defines them) and a matmul per GPU that names a slow one.
On a CPU machine it runs with gloo and fp32 and says what it cannot check. Exit code 0 without FAIL, else 1.

  --nproc-per-node N    start N local ranks (NCCL on GPUs, gloo on CPUs)
  --json FILE           also write every finding and measurement as JSON
  --local               only this host's checks: no collectives, no matmul
  --sizes LIST          collective sizes, e.g. 1M,64M,1G (bytes; K/M/G = KiB/MiB/GiB; nccl-tests' size:
                        the buffer of an all-reduce, the gathered output of an all-gather)
                        default 1M,32M,256M,1G on GPUs, 64K,1M,8M on CPUs
  --iters N             timed calls per size and matmul (default 20 on GPUs, 5 on CPUs)
  --matmul-size N       the square GEMM's side (default 8192 bf16 on GPUs, 512 fp32 on CPUs)
  --slow-fraction F     name a rank whose matmul is more than F below the median (default 0.1)
  --min-busbw GBPS      FAIL when the largest size's bus bandwidth is below GBPS (an acceptance test)
  --timeout SECONDS     how long ranks wait for each other to start (default 300)"""

_VALUED = (
    "--nproc-per-node",
    "--json",
    "--sizes",
    "--iters",
    "--matmul-size",
    "--slow-fraction",
    "--min-busbw",
    "--timeout",
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``64K`` / ``1M`` / ``1G`` / ``4096`` (bytes) -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    number = t[:-1] if unit else t
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ConfigError(
            "--sizes", text, "expected sizes like 1M,64M,1G (bytes; K/M/G = KiB/MiB/GiB)"
        ) from None
    if value < 4:
        raise ConfigError("--sizes", text, "a size of at least 4 bytes (one float32)")
    return int(value)


def _number(name: str, text: str, kind, low: float, high: float | None = None, what: str = ""):
    try:
        value = kind(text)
    except ValueError:
        raise ConfigError(name, text, what or f"expected a {'whole ' if kind is int else ''}number") from None
    if value < low or (high is not None and value >= high) or (kind is float and value != value):
        raise ConfigError(name, value, what)
    return value


def parse_args(argv: list[str]):
    """(--nproc-per-node or None, --json path or None, doctor Options)."""
    from loom.cluster.doctor import Options

    values, local, i = {}, False, 0
    while i < len(argv):
        name, eq, val = argv[i].partition("=")
        name = name.replace("_", "-")
        if name == "--local" and not eq:
            local = True
        elif name in _VALUED:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(name, None, "missing value after the option", show_value=False)
                val, i = argv[i + 1], i + 1
            values[name] = val
        else:
            raise ConfigError(
                argv[i], None, "unknown option or argument; see `loom doctor --help`", show_value=False
            )
        i += 1
    opts = Options(local_only=local)
    nproc = None
    if "--nproc-per-node" in values:
        nproc = _number(
            "--nproc-per-node", values["--nproc-per-node"], int, 1, what="expected a positive integer"
        )
    if "--sizes" in values:
        opts.sizes = [parse_size(s) for s in values["--sizes"].split(",") if s.strip()]
        if not opts.sizes:
            raise ConfigError("--sizes", values["--sizes"], "expected sizes like 1M,64M,1G")
    if "--iters" in values:
        opts.iters = _number("--iters", values["--iters"], int, 1, what="expected a positive integer")
    if "--matmul-size" in values:
        opts.matmul_size = _number(
            "--matmul-size", values["--matmul-size"], int, 16, what="expected an integer of at least 16"
        )
    if "--slow-fraction" in values:
        opts.slow_fraction = _number(
            "--slow-fraction",
            values["--slow-fraction"],
            float,
            1e-9,
            1.0,
            what="expected a fraction between 0 and 1, e.g. 0.1",
        )
    if "--min-busbw" in values:
        opts.min_busbw = _number("--min-busbw", values["--min-busbw"], float, 0.0, what="expected GB/s >= 0")
    if "--timeout" in values:
        opts.timeout_s = _number("--timeout", values["--timeout"], float, 1.0, what="expected seconds >= 1")
    return nproc, values.get("--json"), opts


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    nproc, json_path, opts = parse_args(argv)
    if json_path:
        from loom.config.paths import check_file_writable

        check_file_writable("--json", json_path, "doctor.json")
    if nproc and nproc > 1 and "WORLD_SIZE" not in os.environ:
        import torch

        if torch.cuda.is_available() and nproc > torch.cuda.device_count():
            raise ConfigError(
                "--nproc-per-node",
                nproc,
                f"this host shows {torch.cuda.device_count()} GPU(s); one rank per GPU",
            )
        return launch(_without_nproc(argv), nproc)
    from loom.cluster.doctor import render, run, write_json

    report = run(opts)
    if report.is_main:
        print(render(report), flush=True)
        if json_path:
            write_json(report, json_path)
            print(f"wrote {json_path}")
    code = report.exit_code
    result_file = os.environ.get(RESULT_ENV)
    if result_file:  # under loom's own launcher: rank 0's verdict goes back through a file
        if report.is_main:
            with open(result_file, "w") as fh:
                fh.write(str(code))
        return 0
    return code


RESULT_ENV = "LOOM_DOCTOR_RESULT"


def _without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.partition("=")[0].replace("_", "-")
        if name == "--nproc-per-node":
            skip = "=" not in a
            continue
        out.append(a)
    return out


def launch(argv: list[str], nproc: int) -> int:
    """``nproc`` local ranks through torch.distributed.run, each running ``python -m loom doctor``; rank 0 reports
    and hands its verdict back in a file, so a FAIL finding is exit code 1 here without a launcher traceback."""
    import tempfile

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from loom.runtime.topology import usable_cpus

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))  # torchrun keeps a set one
    with tempfile.TemporaryDirectory(prefix="loom-doctor-") as tmp:
        result = os.path.join(tmp, "exit_code")
        os.environ[RESULT_ENV] = result
        args = get_args_parser().parse_args(
            ["--standalone", f"--nproc-per-node={nproc}", "--module", "loom", "doctor", *argv]
        )
        try:
            run(args)
        except ChildFailedError as err:
            codes = sorted({f.exitcode for f in err.failures.values()})
            print(f"loom: a doctor rank failed (exit codes {codes}); see its message above", file=sys.stderr)
            return 2 if set(codes) == {2} else 1
        finally:
            os.environ.pop(RESULT_ENV, None)
        try:
            with open(result) as fh:
                return int(fh.read().strip() or 1)
        except (OSError, ValueError):
            return 1
