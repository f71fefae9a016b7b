"""The `kvcheck` command line: parsing and dispatch only.

Each command's body lives in its own module (cmd_*.py, and explore/prove/report for theirs);
what they share (one-line errors, output, progress, path checks) is common.py. Every bad input
becomes one clear line on stderr with exit code 2; Ctrl-C is exit 130.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from .. import __version__
from ..fuzz import faults as faultlib
from ..spec.config import ConfigError
from ..spec.trace import TraceError
from ..spec.verdict import SUMMARY as EXIT_SUMMARY
from ..spec.verdict import ExitCode
from ..fuzz.suts import SutError
from .cmd_matrix import add_matrix_arguments
from .common import OneLineParser, UsageError, nonneg_int, positive_int


# ---- parser ----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="kvcheck",
        description="Verify prefix-cache reuse in hybrid-attention LLM serving: a prefix-cache "
                    "hit must be usable (every per-layer cache object complete, current and "
                    "readable) and reuse must equal a full recompute.",
        epilog=EXIT_SUMMARY, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvcheck {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str, config: bool = True):
        sp = sub.add_parser(name, help=help, description=help, epilog=EXIT_SUMMARY,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if config:
            sp.add_argument("--config", metavar="FILE", help="JSON config (default: the embedded default)")
        sp.set_defaults(fn=fn)
        return sp

    add("spec", _lazy("cmd_info", "cmd_spec"), "describe the executable spec: objects, actions, funnel, invariants, decisions")
    add("faults", _lazy("cmd_info", "cmd_faults"), "list every planted fault and the check expected to catch it", config=False)
    e = add("engines", _lazy("cmd_engines", "cmd_engines"),
            "list the registered engines (the kvcheck.engines entry points): release, layouts, faults", config=False)
    e.add_argument("name", nargs="?", help="only this engine")
    e.add_argument("--layouts", action="store_true", help="also list each engine's layouts")
    g = add("gate", _lazy("cmd_gate", "cmd_gate"), "the CI profile: run every engine at CI bounds, one verdict, a report")
    g.add_argument("--out", metavar="DIR", default="kvcheck-report", help="report directory (default: %(default)s)")
    g.add_argument("--fault", metavar="NAME", help="plant a fault; the run must fail with its expected invariant")
    g.add_argument("--seed", type=int, default=None, help="seed of every random choice (default: 0)")
    g.add_argument("--steps", type=positive_int, default=None,
                   help="walk steps (default: 10000 clean, up to 400000 with --fault)")
    g.add_argument("--project", metavar="FILE", help="project file naming the systems to check (default: "
                   "[tool.kvcheck] in ./pyproject.toml, else ./kvcheck.toml; without one, the default profile)")
    g.add_argument("--strict-known", action="store_true",
                   help="with a project file: as its known_strict = true (an acknowledged defect the release "
                        "under test cannot have fails the gate)")
    g.add_argument("--junit", metavar="FILE", help="also write the checks as JUnit XML (one test case per "
                   "system, engine and check)")
    i = add("init", _lazy("cmd_init", "cmd_init"), "write a commented starter kvcheck.toml for `kvcheck gate`",
            config=False)
    i.add_argument("--force", action="store_true", help="overwrite an existing file")
    i.add_argument("--file", metavar="FILE", default="kvcheck.toml", help="where (default: %(default)s)")
    r = add("replay", _lazy("cmd_replay", "cmd_replay"), "replay a trace on the spec (and a system under test)")
    r.add_argument("trace", metavar="TRACE", help="trace file (JSON, kvcheck-trace/1)")
    r.add_argument("--sut", metavar="NAME", help="also replay on this system under test: spec, reference, "
                   "vllm or MODULE:CLASS (vllm traces replay on vLLM by default)")
    r.add_argument("--without-fault", action="store_true", help="build the SUT without the planted fault "
                   "the trace was found with (its fixed version): a fix replays with exit 0")
    r.add_argument("--reproducer", metavar="DIR", help="also write the trace's standalone reproducer (vLLM, "
                   "SGLang: a script that needs only the engine) into DIR, with a copy of the trace")
    z = add("fuzz", _lazy("cmd_fuzz", "cmd_fuzz"), "Hypothesis stateful campaign: drive a system under test in lockstep with the spec")
    z.add_argument("--sut", default="spec", metavar="NAME",
                   help="spec (default), reference, vllm, or MODULE:CLASS implementing "
                        "kvcheck.spec.sut.SystemUnderTest")
    z.add_argument("--budget", default="60s", help="time (60s, 5m) or steps (20000) (default: %(default)s)")
    z.add_argument("--seed", type=int, default=0, help="campaign seed (default: %(default)s)")
    z.add_argument("--workers", type=positive_int, default=None,
                   help="processes sharing the example database (default: 1); with --ray, the "
                        "shards (seeds seed..seed+N-1; default: the cluster's CPUs)")
    z.add_argument("--fault", metavar="NAME", help="plant a fault in the SUT")
    z.add_argument("--exhaustive", type=positive_int, default=None, metavar="DEPTH",
                   help="instead of random programs, run every program of up to DEPTH steps (breadth "
                        "first, each from reset, a (spec state, observed SUT state) already reached not "
                        "expanded again); --budget bounds it (then it says 'to depth k<DEPTH', exit 3). "
                        "The generic lockstep's SUTs only (spec, reference, MODULE:CLASS): engines with "
                        "their own driver (vllm, sglang, transformers) are refused")
    z.add_argument("--db", metavar="DIR", help="Hypothesis example database directory (replayed first)")
    z.add_argument("--out", metavar="DIR", default="kvcheck-report", help="where traces go (default: %(default)s)")
    z.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the shards as Ray tasks on the cluster at ADDRESS (without one: "
                        "RAY_ADDRESS, a cluster started on this machine, or a new local one); "
                        "needs pip install 'kvcheck[scale]'")
    z.add_argument("--redis", metavar="URL", default=None,
                   help="Hypothesis example database in Redis (redis://HOST:PORT/DB), shared by "
                        "every worker and later run (default: $KVCHECK_REDIS)")
    z.add_argument("--observability", metavar="FILE",
                   help="append Hypothesis observability records (JSON lines: one per test case, "
                        "with its status, features and timing) to FILE; with --workers N, one file "
                        "per worker (FILE.wK.jsonl)")
    z.add_argument("--layout", metavar="NAME", help="--sut vllm: the hybrid layout to drive")
    z.add_argument("--cover", action="store_true",
                   help="--sut vllm|sglang: measure line and branch coverage of the engine's own cache code "
                        "over the campaign (JSON engine_coverage, one line per file, and an annotated "
                        "listing of the lines never reached under --out); slower")
    z.add_argument("--acknowledge", metavar="NAME=REASON", action="append",
                   help="--sut vllm|sglang: accept a known engine defect (shown, not failing); without it a "
                        "recognised known defect is a finding with its check's exit code (repeatable; the "
                        "project file's [known] table is the same)")
    z.add_argument("--strict-known", action="store_true", default=None,
                   help="--sut vllm|sglang: an acknowledged defect (--acknowledge) this release cannot have "
                        "fails the run (\"fixed? remove the entry\"); the project file's known_strict = true")
    z.add_argument("--list-layouts", action="store_true", help="--sut vllm|sglang: list the layouts")
    z.add_argument("--layout-file", metavar="FILE", help="--sut vllm / sglang: a layout of your own (JSON; docs/adapters-vllm.md)")
    z.add_argument("--workload", metavar="NAME", default=None,
                   help="--sut vllm: what the requests look like: random (default: three base prompts "
                        "cut at random points) or chat (resends with a few tokens appended or edited, "
                        "siblings diverging anywhere, multi-turn growth, a shared system prompt)")
    z.add_argument("--sched-policy", metavar="NAME", default=None,
                   help="--sut vllm: the scheduler's policy in the scheduler-driven episodes: fcfs "
                        "(default, vLLM's) or priority (the preemption victim is the max by (priority, "
                        "arrival), possibly a request already scheduled in the step)")
    z.add_argument("--drive", metavar="NAME", default=None,
                   help="--sut vllm: who decides the steps: auto (default: engine wherever it can run the "
                        "request, else mixed; the result's drive_reason says why), engine (vLLM's own v1 "
                        "Scheduler: kvcheck submits, aborts and steps, the release's scheduler admits, chunks "
                        "and preempts; knobs drawn per episode) or mixed (the manager drive: kvcheck's step "
                        "generator over vLLM's KV cache manager, one request or a modelled scheduler step per "
                        "action; it runs the dense twin, --workload chat, --layout generated and --ray)")
    z.add_argument("--steer", metavar="NAME", default=None,
                   help="--sut vllm|sglang: where episodes come from: random (default: each one fresh) or coverage "
                        "(an episode that reaches arcs of the engine's cache code not reached before is kept in a "
                        "corpus; later episodes replay a prefix of a kept one and extend it: docs/search.md)")
    z.add_argument("--strict-reuse", action="store_true",
                   help="--sut vllm: lost reuse (spec-usable hit > vLLM hit) fails the run (exit 13)")
    ac = add("adapter-check", _lazy("cmd_adapter_check", "cmd_adapter_check"),
             "lint an adapter before a campaign: constructor errors, declared actions the spec never "
             "enables, state fields it never reports, its faults")
    ac.add_argument("sut", metavar="MODULE:CLASS", help="the adapter (as for kvcheck fuzz --sut)")
    ac.add_argument("--steps", type=positive_int, default=2000, help="lockstep steps to drive (default: %(default)s)")
    ac.add_argument("--seed", type=int, default=0, help="seed of the run (default: %(default)s)")
    m = add("mutants", _lazy("cmd_mutants", "cmd_mutants"), "fault matrix: which engine catches each planted fault, with which check")
    m.add_argument("--budget-per-fault", default="30s", help="per fault and engine (default: %(default)s)")
    m.add_argument("--fault", nargs="*", metavar="NAME", help="only these faults (default: all)")
    m.add_argument("--seed", type=int, default=0, help="seed (default: %(default)s)")
    m.add_argument("--workers", type=positive_int, default=1,
                   help="faults run in this many processes, one core each (default: %(default)s)")
    d = add("diff", _lazy("cmd_diff", "cmd_diff"), "differential oracle: output with cache reuse vs a full recompute")
    d.add_argument("--cover", action="store_true",
                   help="--sut transformers: measure line and branch coverage of its cache code "
                        "(transformers.cache_utils) over the scenarios (as kvcheck fuzz --cover)")
    d.add_argument("--sut", default="reference", metavar="NAME",
                   help="a registered engine with a model: reference, transformers (`kvcheck engines`; "
                        "default: %(default)s)")
    d.add_argument("--backend", default="torch", choices=["torch", "triton"],
                   help="kernel backend of the reference model (default: %(default)s; triton runs in "
                        "interpreter mode without a GPU)")
    d.add_argument("--out", metavar="DIR", default="kvcheck-report", help="where reproducers go (default: %(default)s)")
    d.add_argument("--cache-dir", metavar="DIR", help="reference engine: put the disk tier here "
                   "(default: a fresh temporary directory per engine)")
    d.add_argument("--model-type", metavar="NAME", help="transformers model_type (e.g. mistral, gemma3_text)")
    d.add_argument("--config-json", metavar="FILE", help="JSON overrides of the tiny default model config")
    d.add_argument("--patterns", metavar="SET", default=None,
                   help="--sut transformers: the layer patterns to run: default (the derived one), checkpoint (the "
                        "class's own, cut short), orderings (every order of its layer kinds, up to 4 layers, at most "
                        "8), all (default: default)")
    d.add_argument("--sizes", metavar="HOW", default=None,
                   help="--sut transformers: fixed (kvcheck's small granularities) or ratios (the model's own "
                        "windows, chunks, compress rates and index top-k scaled together) (default: fixed)")
    d.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"],
                   help="model dtype (default: %(default)s)")
    d.add_argument("--list-models", action="store_true", help="--sut transformers: list every hybrid model type "
                   "with its last verdict (kept in --out DIR/transformers-verdicts.json)")
    d.add_argument("--scenarios", type=positive_int, default=None,
                   help="scenarios (default: 200 for the reference engine, 20 for transformers)")
    d.add_argument("--seed", type=int, default=0, help="seed of every random choice (default: %(default)s)")
    d.add_argument("--acknowledge", metavar="NAME=REASON", action="append",
                   help="--sut transformers: accept a known transformers defect its signature recognises (shown, "
                        "not failing: `kvcheck engines transformers`); repeatable")
    d.add_argument("--fault", metavar="NAME", help="plant a fault: an engine fault (`kvcheck faults`) for the "
                   "reference engine; drop_window_position, perturb_key, crop_keeps_stale, shared_copy_aliases, "
                   "generate_stale_prefix or pad_rows_swapped[@LAYER] for transformers")
    pr = add("prove", _lazy("cmd_prove", "cmd_prove"), "Z3: inductive proofs of every invariant, BMC, hit soundness")
    pr.add_argument("--blocks", type=positive_int, default=None, help="override config.blocks")
    pr.add_argument("--depth", type=nonneg_int, default=None, help="BMC depth (default: 8 clean, 14 when induction fails, 18 with --fault: "
                    "every spec fault's shortest counterexample)")
    pr.add_argument("--fault", metavar="NAME", help="plant a spec fault; BMC must find it")
    pr.add_argument("--out", metavar="DIR", default=None, help="write prove.json and traces here")
    ex = add("explore", _lazy("cmd_explore", "cmd_explore"), "exhaustive explicit-state exploration of the spec (BFS)")
    ex.add_argument("--max-states", type=positive_int, default=2_000_000, help="state budget (default: %(default)s)")
    ex.add_argument("--fault", metavar="NAME", help="plant a spec fault; BFS finds the shortest violation")
    ex.add_argument("--graph", metavar="FILE", default=None, help="export the state graph (FILE.graphml or FILE.dot)")
    ex.add_argument("--out", metavar="DIR", default=None, help="write explore.json, diagrams and traces here")
    mx = add("matrix", _lazy("cmd_matrix", "cmd_matrix"),
             "every release of an engine x every layout: one verdict per cell (clean, finding, cannot "
             "express, cannot drive, undecided, error)", config=False)
    add_matrix_arguments(mx)
    rp = add("report", _lazy("report", "cmd_report"), "render the report directory as Markdown (and HTML)", config=False)
    rp.add_argument("--in", dest="in_dir", metavar="DIR", default="kvcheck-report", help="report directory (default: %(default)s)")
    rp.add_argument("--html", action="store_true", help="also write one self-contained report.html")
    return p


def _lazy(module: str, name: str) -> Callable[[argparse.Namespace], int]:
    """Import a command's module only when it runs (z3, torch, vLLM load only where needed)."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f"kvcheck.checker.{module}"), name)(args)
    return run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "fn", None):
        parser.print_help()
        return ExitCode.USAGE
    try:
        return int(args.fn(args))
    except (ConfigError, TraceError, faultlib.UnknownFault, faultlib.FaultError, UsageError, SutError) as e:
        print(f"kvcheck {args.command}: error: {_one_line(e)}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print(f"kvcheck {args.command}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        return ExitCode.OK


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def entry() -> None:
    from ..fuzz.pool import keep_interrupts
    keep_interrupts()            # a Ctrl-C inside a gc callback is re-raised, not printed and lost
    sys.exit(main())


if __name__ == "__main__":
    entry()
