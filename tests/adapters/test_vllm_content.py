"""The content model's prefixes (content.py): the same value as (salt, tuple(tokens[:n])), O(1)."""
from __future__ import annotations

from types import SimpleNamespace as NS

from hypothesis import given, settings, strategies as st

from kvcheck.engines.vllm.checks import Req
from kvcheck.engines.vllm.content import prefix
from kvcheck.engines.vllm.mamba import holds

toks = st.lists(st.integers(0, 50), max_size=40)


def _req(tokens, salt=None):
    return Req("r", NS(all_token_ids=tokens), salt)


@settings(deadline=None)
@given(toks, toks, st.integers(0, 45), st.integers(0, 45), st.sampled_from([None, "s"]))
def test_a_prefix_compares_as_the_tuple_of_its_tokens(a, b, n, m, salt):
    pa, pb = prefix(_req(a, salt), n), prefix(_req(b), m)
    ta, tb = (salt, tuple(a[:n])), (None, tuple(b[:m]))
    assert (pa == pb) == (ta == tb) and len(pa[1]) == len(ta[1])
    assert pa[1] == ta[1] and list(pa[1]) == list(ta[1])
    assert (pa == pb) <= (hash(pa) == hash(pb))
    # the KV-prefix relation the timeline asks (a block's bytes hold a shorter prefix of its writer)
    assert holds(pa, pb, False) == holds(ta, tb, False)
    assert holds(pa, pb, True) == (ta == tb)


def test_tokens_that_arrive_later_extend_the_same_chain_and_old_prefixes_keep_their_value():
    tokens = [1, 2, 3]
    r = _req(tokens)
    p2 = prefix(r, 2)
    tokens += [4, 5]
    assert prefix(r, 5)[1] == (1, 2, 3, 4, 5) and prefix(r, 5)[1][:2] == p2[1]
    assert prefix(r, 9)[1] == (1, 2, 3, 4, 5)          # (past the tokens: what is there)
    del tokens[3:]                                     # a list that shrank and grew otherwise
    tokens.append(7)
    assert prefix(r, 4)[1] == (1, 2, 3, 7) and prefix(r, 4) != prefix(_req([1, 2, 3, 4]), 4)
