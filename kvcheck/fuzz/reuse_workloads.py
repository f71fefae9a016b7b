"""Release-independent workloads for the cross-release differential (checker/differential.py).

The same steps must run on every release of an engine, so they are generated here, in the core,
from a printed seed at the sizes the engine gives for a layout (`Engine.reuse_sizes`: kvcheck's
own data, never the release's). A workload is a JSON-able dict {"name", "kind", "seed", "steps"};
a step is {"op": "send", "r", "tokens", "output", "chunk"} (submit, compute the whole prompt in
chunks of `chunk` tokens, None: at once, then decode `output`) or {"op": "finish", "r"}.

Four kinds, cycled: multi-turn chats (each turn the previous prompt, its output and a new user
turn), identical resends (after the first finished and while it runs, and one with its last
token edited), a shared system prompt with diverging suffixes (several users at once), and long
prompts crossing several blocks with siblings diverging inside a block and on its edge.
A campaign's trace becomes a workload through its engine (`Engine.trace_workload`, with FromTrace).
"""
from __future__ import annotations

import random
from typing import Any, Callable

KINDS = ("chat", "resend", "system", "long")
SIZE_KEYS = ("block", "max_tokens", "vocab")


def check_sizes(sizes: Any) -> dict[str, int]:
    """The engine's sizes, checked (ValueError, one line, naming the key)."""
    if not isinstance(sizes, dict):
        raise ValueError(f"reuse sizes: expected a mapping of {', '.join(SIZE_KEYS)}, not {type(sizes).__name__}")
    out: dict[str, int] = {}
    for k in SIZE_KEYS:
        v = sizes.get(k)
        if type(v) is not int or v < 1:
            raise ValueError(f"reuse sizes: {k} must be a positive integer, not {v!r}")
        out[k] = v
    if out["max_tokens"] < 2 * out["block"] + 8:
        raise ValueError(f"reuse sizes: max_tokens {out['max_tokens']} leaves no room for two blocks")
    return out


class _Steps:
    """One workload's steps, drawn from its own rng at the layout's sizes."""

    def __init__(self, rng: random.Random, sizes: dict[str, int]) -> None:
        self.rng, self.block, self.vocab = rng, sizes["block"], sizes["vocab"]
        self.cap = sizes["max_tokens"] - 6            # room for the output
        self.steps: list[dict[str, Any]] = []
        self.n = 0

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(max(0, n))]

    def blocks(self, lo: int, hi: int) -> int:
        """Tokens crossing lo..hi blocks (at any offset inside the last), within the cap."""
        return min(self.cap, self.rng.randint(lo, hi) * self.block + self.rng.randrange(self.block))

    def chunk(self) -> int | None:
        b = self.block
        return self.rng.choice([None, None, b, 2 * b, self.rng.randint(1, 2 * b)])

    def send(self, tokens: list[int], output: int | None = None) -> tuple[str, list[int]]:
        """A request for `tokens` (cut to the cap); its id and its output tokens."""
        r, self.n = f"q{self.n}", self.n + 1
        out = self.fresh(self.rng.randint(1, 4) if output is None else output)
        self.steps.append({"op": "send", "r": r, "tokens": list(tokens[: self.cap]) or self.fresh(2),
                           "output": out, "chunk": self.chunk()})
        return r, out

    def finish(self, r: str) -> None:
        self.steps.append({"op": "finish", "r": r})


def _chat(s: _Steps) -> None:
    prompt = s.fresh(s.blocks(1, 2))
    for _ in range(s.rng.randint(2, 4)):
        r, out = s.send(prompt)
        s.finish(r)
        prompt = prompt + out + s.fresh(s.rng.randint(2, 2 * s.block))
        if len(prompt) >= s.cap:
            break


def _resend(s: _Steps) -> None:
    p = s.fresh(s.blocks(1, 4))
    a, _ = s.send(p)
    s.finish(a)
    b, _ = s.send(p)                               # identical, after the first finished
    c, _ = s.send(p)                               # identical, while the second runs
    s.finish(b)
    s.finish(c)
    edited = p[:-1] + [(p[-1] + 1) % s.vocab]
    d, _ = s.send(edited)
    s.finish(d)


def _system(s: _Steps) -> None:
    system = s.fresh(s.blocks(1, 3))
    alive: list[str] = []
    for _ in range(s.rng.randint(3, 4)):
        r, _ = s.send(system + s.fresh(s.rng.randint(1, 2 * s.block)))
        alive.append(r)
        if len(alive) > 2 or s.rng.random() < 0.4:
            s.finish(alive.pop(s.rng.randrange(len(alive))))
    for r in alive:
        s.finish(r)


def _long(s: _Steps) -> None:
    p = s.fresh(s.blocks(3, max(3, s.cap // s.block - 1)))
    a, _ = s.send(p)
    s.finish(a)
    inside = s.rng.randrange(1, len(p))            # diverging at any token, inside a block
    edge = s.rng.randint(1, max(1, len(p) // s.block)) * s.block
    for d in (inside, min(edge, len(p) - 1)):
        r, _ = s.send(p[:d] + [(p[d] + 1) % s.vocab] + s.fresh(s.rng.randint(0, s.block)))
        s.finish(r)
    r, _ = s.send(p + s.fresh(s.rng.randint(1, s.block)))       # the same prompt, extended
    s.finish(r)


_KINDS: dict[str, Callable[[_Steps], None]] = {"chat": _chat, "resend": _resend, "system": _system, "long": _long}


def generate(seed: int, count: int, sizes: dict[str, int]) -> list[dict[str, Any]]:
    """`count` workloads from `seed` at `sizes` (check_sizes), the kinds in turn; each has its
    own rng, so a workload does not change when `count` does."""
    sz = check_sizes(sizes)
    out = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        s = _Steps(random.Random(seed * 1_000_003 + i), sz)
        _KINDS[kind](s)
        out.append({"name": f"{kind}-s{seed}-{i}", "kind": kind, "seed": seed, "steps": s.steps})
    return out


class FromTrace:
    """A campaign trace's requests turned into one workload, written once for every engine's
    `Engine.trace_workload` (the engine maps its own action vocabulary onto these four calls).

    A request becomes a "send" where the trace first schedules it (`schedule`: its prompt as
    submitted, the token budget of its first chunk when smaller than the prompt), with the
    tokens the trace decodes for it as its output, and a "finish" where the trace finishes or
    aborts it; one never scheduled is left out. Everything else of the trace is dropped by
    construction: later chunk sizes, preemption and resumption, drafts, evictions and resets,
    salts and priorities, several requests in one step. Malformed parameters (the trace's steps
    are the engine's, unchecked on load) are a ValueError naming the step."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.sends: dict[str, dict[str, Any]] = {}     # the live sends, by request
        self.steps: list[dict[str, Any]] = []
        self.at = ""

    def step(self, i: int, action: str) -> None:
        self.at = f"steps[{i}] ({action})"

    def rid(self, r: Any) -> str:
        if not isinstance(r, str) or not r:
            raise ValueError(f"{self.at}: the request id must be text, not {r!r}")
        return r

    def submit(self, r: Any, tokens: Any) -> None:
        if not isinstance(tokens, list) or not tokens or not all(type(t) is int and t >= 0 for t in tokens):
            raise ValueError(f"{self.at}: tokens must be a non-empty list of token ids (non-negative integers)")
        self.prompts[self.rid(r)] = list(tokens)

    def schedule(self, r: Any, chunk: Any = None) -> None:
        r = self.rid(r)
        if chunk is not None and (type(chunk) is not int or chunk < 1):
            raise ValueError(f"{self.at}: the chunk must be a positive integer, not {chunk!r}")
        if r in self.sends or r not in self.prompts:      # running already, or never submitted
            return
        toks = self.prompts.pop(r)
        self.sends[r] = {"op": "send", "r": r, "tokens": toks, "output": [],
                         "chunk": chunk if chunk is not None and chunk < len(toks) else None}
        self.steps.append(self.sends[r])

    def output(self, r: Any, tok: Any) -> None:
        if type(tok) is not int or tok < 0:
            raise ValueError(f"{self.at}: the token must be a token id (a non-negative integer), not {tok!r}")
        if self.rid(r) in self.sends:
            self.sends[r]["output"].append(tok)

    def finish(self, r: Any) -> None:
        r = self.rid(r)
        self.prompts.pop(r, None)
        if self.sends.pop(r, None) is not None:
            self.steps.append({"op": "finish", "r": r})

    def workload(self, name: str, seed: Any = None) -> dict[str, Any] | None:
        """The workload (None: the trace scheduled no request)."""
        if not any(st["op"] == "send" for st in self.steps):
            return None
        return {"name": name, "kind": "trace", "seed": seed if type(seed) is int else None, "steps": self.steps}


def check_workloads(data: Any, where: str) -> list[dict[str, Any]]:
    """Workloads read from a file (a list of them, or one difference with its "trace"), checked:
    ValueError, one line, naming the path and the field."""
    if isinstance(data, dict) and "trace" in data:
        data = [data["trace"]]
    if not isinstance(data, list) or not data:
        raise ValueError(f"{where}: expected a non-empty list of workloads (or a difference with a 'trace')")
    for i, w in enumerate(data):
        at = f"{where}: workload {i}"
        if not isinstance(w, dict) or not isinstance(w.get("name"), str) or not isinstance(w.get("steps"), list):
            raise ValueError(f"{at}: expected an object with a 'name' (text) and 'steps' (a list)")
        for j, st in enumerate(w["steps"]):
            _check_step(st, f"{at} step {j}")
    return data


def _check_step(st: Any, at: str) -> None:
    if not isinstance(st, dict) or st.get("op") not in ("send", "finish") or not isinstance(st.get("r"), str):
        raise ValueError(f"{at}: expected {{'op': 'send' or 'finish', 'r': text, ...}}")
    if st["op"] == "finish":
        return
    for key in ("tokens", "output"):
        v = st.get(key)
        if not isinstance(v, list) or not all(type(t) is int and t >= 0 for t in v) or (key == "tokens" and not v):
            raise ValueError(f"{at}: {key} must be a list of token ids (non-negative integers)")
    c = st.get("chunk")
    if c is not None and (type(c) is not int or c < 1):
        raise ValueError(f"{at}: chunk must be a positive integer or null, not {c!r}")
