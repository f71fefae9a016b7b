"""How a standalone SGLang reproducer reads the tree and the pools (spliced into
sglang_repro_template.TEMPLATE): every node with the tokens before it, a node's path of slots,
the cached page-aligned prefixes, the free slots per pool, a full slot's SWA slot. Kept apart
from the driver that plays the operations and from the conditions it checks: the script's
"views" of SGLang's state, as sglang_checks.ShadowChecks reads them for the adapter.
"""

VIEWS = r'''def tree():
    out, stack = [], [(root, ())]
    while stack:
        node, path = stack.pop()
        for ch in node.children.values():
            out.append((ch, path))
            stack.append((ch, path + tuple(int(t) for t in ch.key)))
    return out


def swa_of(s):
    return int(alloc.full_to_swa_index_mapping[s])


def free_sets():
    def fr(a):
        return {int(x) for t in (a.free_pages, getattr(a, "release_pages", None)) if t is not None for x in t.tolist()}
    if SWA:
        return fr(alloc.full_attn_allocator), fr(alloc.swa_attn_allocator)
    pages = alloc.get_all_free_pages().tolist() if PAGE > 1 and hasattr(alloc, "get_all_free_pages") else sorted(fr(alloc))
    return ({p * PAGE + i for p in pages for i in range(PAGE)} if PAGE > 1 else set(pages)), set()


def path_slots(node):
    parts = []
    while node is not root:
        parts.append([int(v) for v in node.value.tolist()]); node = node.parent
    return [v for part in reversed(parts) for v in part]


def prefixes():
    out = set()
    for node, path in tree():
        full = path + tuple(int(t) for t in node.key)
        for end in range((len(path) // PAGE + 1) * PAGE, len(full) + 1, PAGE):
            out.add(full[:end])
    return out


'''
