"""``loom train``: argv -> preflight (loom.cli.preflight) -> this process trains, or the elastic launch
(loom.runtime.launch) starts workers under PyTorch's elastic agent (local, restarted, on several nodes)."""

from __future__ import annotations

import difflib
import gc
import sys

from loom.cli.preflight import dry_run, elastic_note, load_config, preflight
from loom.config import ConfigError, to_toml
from loom.runtime.launch import LAUNCH_OPTIONS, env_world_size, launch, parse_launch
from loom.runtime.run_lock import acquire
from loom.train.run_dir import check_writable_dirs, checkpoint_dir

USAGE = """usage: loom train [--config FILE.toml] [--nproc-per-node N] [--section.field VALUE ...]
                  [--print-config] [--dry-run]
                  [--max-restarts N] [--nnodes N|MIN:MAX] [--node-rank R] [--rdzv-backend c10d|file]
                  [--rdzv-endpoint HOST:PORT|PATH] [--rdzv-id ID] [--rdzv-conf KEY=VALUE,...]
       loom train --help [SECTION]

Trains with defaults < FILE < overrides. Without --config and --data.source it trains the
`debug` model on this Python's standard-library sources (nothing is downloaded).

options:
  -c, --config FILE       TOML file of [section] tables, written as --print-config prints them
  --nproc-per-node N      start N local worker processes (PyTorch's elastic launcher); plan for N ranks
  --section.field VALUE   one config field (or --section.field=VALUE); the command line wins over FILE
  --print-config          print the config that defaults < FILE < command line give (TOML) and exit
  --dry-run               run every check a start runs, build the model on the meta device, print the plan
                          (layout, parameters, memory per device, tokens per step) and exit; writes nothing
  -h, --help [SECTION]    this text, or SECTION's fields: defaults, allowed values and meaning

restarts and several nodes (PyTorch's elastic agent; docs/operations.md):
  --max-restarts N        when a worker fails (killed, crashed, its node lost), restart all workers up to N times;
                          each restart resumes from the newest complete checkpoint and is recorded in
                          <run.dir>/restarts.jsonl and metrics.jsonl (default 0)
  --nnodes N|MIN:MAX      nodes in the job (default 1), one `loom train` per node; MIN:MAX is elastic: the job
                          re-forms when nodes leave or join, with parallel.dp_shard = -1 re-derived for the new size
  --node-rank R           c10d: only node 0 may serve the rendezvous store, the others only connect (default: the
                          first agent on the endpoint's host serves it); node ranks are assigned on arrival
  --rdzv-backend NAME     c10d (default: a TCP store on --rdzv-endpoint HOST:PORT) | file (a file on a filesystem
                          every node mounts: --rdzv-endpoint PATH; no port is served)
  --rdzv-endpoint ADDR    HOST:PORT (c10d) or PATH (file): where the nodes meet; needed with more than one node
  --rdzv-id ID            the job's id, the same on every node (default none)
  --rdzv-conf K=V,...     rendezvous settings, e.g. join_timeout=600,last_call_timeout=30
"""

PREVIEWS = {
    "--print-config": "print-config",
    "--print_config": "print-config",
    "--dry-run": "dry-run",
    "--dry_run": "dry-run",
}
# loom train's own options: a misspelt one is named as such, not as an unknown config key
OPTIONS = (
    "--config",
    "--print-config",
    "--dry-run",
    "--help",
    *(k for k in LAUNCH_OPTIONS if k.startswith("--") and "_" not in k and k != "--config"),
)


def run_worker(argv: list[str]) -> None:
    """The body of every worker process (also ``torchrun -m loom.train``)."""
    from loom.runtime.restarts import record_error

    try:
        _train_worker(argv)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        record_error(err)  # where the elastic agent reads it: the restart record names it
        raise


def _train_worker(argv: list[str]) -> None:
    from loom.cli.preflight import check_layout
    from loom.methods import method_of, rules_of
    from loom.resolve import handing
    from loom.runtime.env import destroy_distributed

    cfg, _ = load_config(argv)
    # the launcher's resolved run is read by the engine; a job an elastic agent (re-)formed without one is
    # resolved here, once, and handed on (a layout its world cannot hold stops here)
    resolved = check_layout(cfg, env_world_size())
    chosen = method_of(cfg)  # training.objective's method runs the job (loom.methods)
    with handing(resolved):
        chosen.run(cfg, chosen.objective(cfg), rules=rules_of(cfg))
    # Only after success: on an error, peers may sit in a collective and a collective teardown would hang
    # (the launcher stops them). The trainer is gone by now (DDP's reducer holds the group), so the group
    # is really torn down here and not at interpreter exit, where gloo's threads can abort the process.
    gc.collect()
    destroy_distributed()


def worker_args(argv: list[str], options) -> list[str]:
    """What the launched workers receive: ``argv`` without the launcher's options (workers must not launch again)."""
    _, overrides = parse_launch(argv)
    return (["--config", options.config] if options.config else []) + overrides


def help_topic(argv: list[str]) -> str | None:
    """None without -h / --help; else '' (the overview) or the SECTION after it (--help SECTION, --help=SECTION)."""
    for i, arg in enumerate(argv):
        name, eq, val = arg.partition("=")
        if name in ("-h", "--help"):
            if eq:
                return val
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("-") else nxt
    return None


def help_text(topic: str) -> str:
    """The usage and the list of config sections, or one section's fields (SECTION.FIELD: its section)."""
    from loom.config.reference import section_text, sections_text

    if not topic:
        return f"{USAGE}\n{sections_text()}"
    return section_text(topic.split(".")[0] if "." in topic else topic)


def take_previews(argv: list[str]) -> tuple[set[str], list[str]]:
    """(the previews asked for: 'print-config', 'dry-run'; the other arguments). An option of loom train's own
    misspelt (``--dryrun``) is one line naming the option it resembles."""
    previews, rest = set(), []
    for arg in argv:
        name = arg.partition("=")[0]
        if name in PREVIEWS:
            previews.add(PREVIEWS[name])
            continue
        if name.startswith("--") and "." not in name and name not in LAUNCH_OPTIONS:
            near = difflib.get_close_matches(name.replace("_", "-"), OPTIONS, n=1, cutoff=0.75)
            if near:
                raise ConfigError(
                    name,
                    None,
                    f"unknown option; did you mean '{near[0]}'? (see `loom train --help`)",
                    show_value=False,
                )
        rest.append(arg)
    return previews, rest


def preview(argv: list[str], previews: set[str]) -> int:
    """--print-config (the config, no checks beyond single fields) and / or --dry-run; nothing is written."""
    if "print-config" in previews:
        sys.stdout.write(to_toml(load_config(argv)[0]))
    if "dry-run" in previews:
        print(dry_run(argv))
    return 0


def main(argv: list[str]) -> int:
    topic = help_topic(argv)
    if topic is not None:
        print(help_text(topic))
        return 0
    previews, argv = take_previews(argv)
    if previews:
        return preview(argv, previews)
    from loom.resolve import handing

    cfg, options, _, _, resolved = preflight(argv)  # resolved once: the workers are handed it
    check_writable_dirs(cfg)  # before anything is built, and held (locked) for the whole run
    if not options.multi_node and (options.agent or env_world_size() == 1):
        # one node: this process holds the lock for its workers, across restarts. Several nodes, or a rank of a
        # job srun / mpirun started: each runs a `loom train` on the same run dir, so rank 0's worker takes it
        # (the OS frees it when that worker dies)
        acquire(cfg.run.dir)
    from loom.checkpoint.manager import refuse_fresh_start

    refuse_fresh_start(cfg.checkpoint, checkpoint_dir(cfg))
    if options.agent:
        if options.elastic and (note := elastic_note(options, resolved)):
            print(note, file=sys.stderr, flush=True)
        with handing(resolved):  # every restart's workers read it (an elastic job: each node count's world)
            return launch(worker_args(argv, options), options, cfg)
    with handing(resolved):
        run_worker(argv)
    return 0
