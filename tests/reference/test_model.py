"""The reference model: reuse == recompute, exactly (`torch.equal`), and the converse: corrupting
one cache object changes the logits, first at the position the layer semantics predict."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from kvcheck.reference.model import HybridLM, ModelState, StateError
from kvcheck.spec.config import Config, LayerSpec

pytestmark = pytest.mark.usefixtures("one_thread")


MODEL = HybridLM()                        # default mix: swa, csa(m=8,k=2), hca(m=16), csa, full
SMALL = HybridLM(Config(layers=(LayerSpec("hca", window=3, m=4), LayerSpec("csa", window=9, m=4,
                                                                             topk=1),
                                LayerSpec("swa", window=1), LayerSpec("full"))), seed=7)
SWA, CSA, HCA, FULL = 0, 1, 2, 4          # layer indices in MODEL


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_state(a: ModelState, b: ModelState) -> None:
    assert a.position == b.position
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), name


def _chunked(model, toks, cuts, state=None):
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(toks))), len(toks)]
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        lg, state = model.prefill(toks[a:b], state)
        outs.append(lg)
    return torch.cat(outs), state


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 70),
       cuts=st.lists(st.integers(1, 69), max_size=5), snap=st.integers(0, 70),
       small=st.booleans())
@example(seed=1, n=49, cuts=[7, 8, 15, 16, 17, 31, 32, 33], snap=24, small=False)
@example(seed=2, n=34, cuts=[5, 6, 23], snap=16, small=True)
@example(seed=3, n=70, cuts=[63, 64, 65, 66], snap=64, small=False)
def test_prefill_chunked_decode_restore_are_bitwise_equal(seed, n, cuts, snap, small):
    model = SMALL if small else MODEL
    toks = _tokens(seed, n)
    logits, state = model.prefill(toks)
    assert logits.shape == (n, 256) and state.position == n
    # any chunking
    lc, sc = _chunked(model, toks, cuts)
    assert torch.equal(lc, logits)
    _same_state(sc, state)
    # token-by-token decode, snapshotting on the way
    st_, outs, snapshot = model.new_state(), [], None
    for t, tok in enumerate(toks):
        if t == min(snap, n - 1):
            snapshot = st_.snapshot()
        lg, st_ = model.decode(tok, st_)
        outs.append(lg)
    assert torch.equal(torch.stack(outs), logits)
    _same_state(st_, state)
    # restore from the snapshot, continue with a (chunked) prefill
    k = snapshot.position
    restored = model.restore(snapshot)
    lr, sr = _chunked(model, toks[k:], [c - k for c in cuts], restored)
    assert torch.equal(lr, logits[k:])
    _same_state(sr, state)
    _same_state(restored, snapshot)        # continuing never mutates the state it started from


@pytest.mark.parametrize("L", [0, 1, 5, 6, 7, 8, 15, 16, 17, 40])
def test_state_holds_exactly_the_recovery_objects(L):
    _, s = MODEL.prefill(_tokens(3, L)) if L else (None, MODEL.new_state())
    for i, spec in enumerate(MODEL.config.layers):
        ls = s.layers[i]
        lo = 0 if spec.kind == "full" else max(0, L - spec.window + 1)
        assert ls.win_k.shape[0] == ls.win_v.shape[0] == L - lo
        if spec.kind in ("hca", "csa"):
            assert ls.comp.shape[0] == L // spec.m
            assert ls.tail_kv.shape[0] == ls.tail_gate.shape[0] == L - spec.m * (L // spec.m)
        if spec.kind == "csa":
            assert ls.idx_keys.shape[0] == L // spec.m
            assert ls.idx_tail_kv.shape[0] == L - spec.m * (L // spec.m)
        rows = MODEL.object_rows(i, L)
        assert set(rows) == set(ls.tensors())
        for f, (a, b, _) in rows.items():
            assert ls.tensors()[f].shape[0] == b - a, f
        assert set(ls.objects) == {"full": {"swa_window"}, "swa": {"swa_window"},
                                   "hca": {"compressed_kv", "tail", "swa_window"},
                                   "csa": {"compressed_kv", "tail", "swa_window", "indexer"}
                                   }[spec.kind]


def test_get_put_roundtrip_and_errors():
    toks = _tokens(4, 30)
    _, s = MODEL.prefill(toks[:20])
    s2 = MODEL.new_state()
    s2.position = s.position
    for i, ls in enumerate(s.layers):
        for obj in ls.objects:
            s2.put(i, obj, {k: v.clone() for k, v in s.get(i, obj).items()})
    assert torch.equal(MODEL.prefill(toks[20:], s2)[0], MODEL.prefill(toks)[0][20:])
    with pytest.raises(KeyError):
        s.get(SWA, "tail")
    with pytest.raises(KeyError):
        s.put(HCA, "tail", {"tail_kv": s.get(HCA, "tail")["tail_kv"]})
    # a dropped (emptied) tail, a window missing a page, a lagging indexer: refused loudly
    for layer, obj, field in [(HCA, "tail", "tail_kv"), (SWA, "swa_window", "win_k"),
                              (CSA, "indexer", "idx_keys")]:
        bad = s.snapshot()
        t = bad.get(layer, obj)
        t[field] = t[field][:-1]
        bad.put(layer, obj, t)
        with pytest.raises(StateError):
            MODEL.prefill(toks[20:], bad)


def test_fingerprint_and_versions():
    again = HybridLM()
    assert again.fingerprint == MODEL.fingerprint and again.versions == MODEL.versions
    other = HybridLM(seed=1)
    assert other.fingerprint != MODEL.fingerprint
    assert set(MODEL.versions) == {"model", "compressor", "indexer", "kernels"}
    assert other.versions["indexer"] != MODEL.versions["indexer"]


# ---- sensitivity: one corrupted object, where it first bites -------------------------------

N = 72
TOKS = _tokens(11, N)
CLEAN_TRACE: dict = {}
CLEAN_LOGITS, _ = MODEL.prefill(TOKS, trace=CLEAN_TRACE)


def _first_diff(state: ModelState, trace: dict | None = None) -> int | None:
    L = state.position
    lg, _ = MODEL.prefill(TOKS[L:], state, trace=trace)
    same = (lg == CLEAN_LOGITS[L:]).all(1)
    bad = (~same).nonzero()
    return None if len(bad) == 0 else L + int(bad[0])


def _state_at(L: int) -> ModelState:
    return MODEL.prefill(TOKS[:L])[1]


def _first_selecting(layer: int, entry: int, start: int) -> int:
    sel = CLEAN_TRACE[f"select.{layer}"]
    return next(t for t in range(start, N) if entry in sel[t].tolist())


def test_clean_restore_has_no_diff():
    assert _first_diff(_state_at(20)) is None


def test_shifted_window_bites_at_once():
    """SWA window holding [L-W, L-1) instead of [L-W+1, L): the very next query reads it."""
    L = 20
    s, stale = _state_at(L), _state_at(L - 1)
    s.put(SWA, "swa_window", stale.get(SWA, "swa_window"))
    assert _first_diff(s) == L


def test_zeroed_tail_bites_when_the_block_completes():
    """hca (m=16): a wrong tail at L=20 corrupts entry 1, first read by query 31 ((31+1)//16=2)."""
    L = 20
    s = _state_at(L)
    s.put(HCA, "tail", {k: torch.zeros_like(v) for k, v in s.get(HCA, "tail").items()})
    assert _first_diff(s) == 31


def test_zeroed_tail_in_csa_bites_when_the_entry_is_selected():
    """csa (m=8, topk=2): the corrupted entry 2 completes at t=23 but only matters once the
    indexer (whose own tail is intact) selects it."""
    L = 20
    s = _state_at(L)
    s.put(CSA, "tail", {k: torch.zeros_like(v) for k, v in s.get(CSA, "tail").items()})
    expect = _first_selecting(CSA, 2, 23)
    assert expect >= 23
    assert _first_diff(s) == expect


def test_wrong_compressed_entry():
    """hca reads every entry: bites at once. csa: at the first query selecting it."""
    L = 40
    s = _state_at(L)
    comp = s.get(HCA, "compressed_kv")["comp"].clone()
    comp[0] += 1.0
    s.put(HCA, "compressed_kv", {"comp": comp})
    assert _first_diff(s) == L
    s = _state_at(L)
    comp = s.get(CSA, "compressed_kv")["comp"].clone()
    later = CLEAN_TRACE[f"select.{CSA}"][L:]
    w = int(later[later >= 0].min())                           # an entry some later query selects
    comp[w] += 1.0
    s.put(CSA, "compressed_kv", {"comp": comp})
    assert _first_diff(s) == _first_selecting(CSA, w, L)


def test_stale_indexer_keys_bite_when_the_selection_changes():
    """Zeroed indexer keys score every old entry 0 (ties -> lowest indices). Harmless while
    every entry is selected anyway (fewer than topk+1 entries, t < 23); bites at the first
    query whose selected set differs."""
    L = 16
    s = _state_at(L)
    idx = s.get(CSA, "indexer")
    idx["idx_keys"] = torch.zeros_like(idx["idx_keys"])
    s.put(CSA, "indexer", idx)
    trace: dict = {}
    first = _first_diff(s, trace)
    sel_bad, sel_ok = trace[f"select.{CSA}"], CLEAN_TRACE[f"select.{CSA}"][L:]
    changed = next(t for t in range(N - L) if not torch.equal(sel_bad[t], sel_ok[t]))
    assert L + changed >= 23
    assert first == L + changed


def test_missing_full_attention_token_bites_at_once():
    L = 30
    s = _state_at(L)
    win = s.get(FULL, "swa_window")
    win["win_v"] = win["win_v"].clone()
    win["win_v"][3] = 0.0
    s.put(FULL, "swa_window", win)
    assert _first_diff(s) == L


def test_thread_count_does_not_change_bits():
    """A cache computed by a process with another intra-op thread count is still reusable."""
    toks = _tokens(5, 150)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, s_one = MODEL.prefill(toks[:90])
        torch.set_num_threads(max(2, threads))
        rest, _ = MODEL.prefill(toks[90:], s_one)
        full, _ = MODEL.prefill(toks)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat([one, rest]), full)


def test_states_are_never_mutated_and_clone_cleanly():
    toks = _tokens(6, 30)
    _, s = MODEL.prefill(toks[:20])
    before = {k: v.clone() for k, v in s.tensors().items()}
    MODEL.prefill(toks[20:], s)
    MODEL.decode(toks[20], s)
    for k, v in s.tensors().items():
        assert torch.equal(v, before[k])
    snap = s.snapshot()
    snap.get(FULL, "swa_window")["win_k"].add_(1.0)          # snapshots are ordinary tensors
    assert not torch.equal(snap.get(FULL, "swa_window")["win_k"], s.get(FULL, "swa_window")["win_k"])
