"""kvcheck adapter for examples/hashchain_manager.py, on kvcheck's hash-chain base class.

    kvcheck adapter-check examples.hashchain_adapter:Adapter --config examples/hashchain.json
    kvcheck fuzz --sut examples.hashchain_adapter:Adapter --config examples/hashchain.json --budget 20s
    kvcheck fuzz --sut examples.hashchain_adapter:Adapter --config examples/hashchain.json --fault hash_ignores_parent
"""
from kvcheck.engines.hashchain.base import HashChainAdapter

from examples.hashchain_manager import BlockManager


class Adapter(HashChainAdapter):
    name = "hashchain-example"
    # planted bug -> the check that must catch it (`--fault NAME`)
    faults = {"stale_hash_after_reuse": "hit_sound_content",
              "hash_ignores_parent": "hit_sound_content",
              "hash_missing_salt": "hit_sound_content",
              "evicts_referenced_block": "toctou_bound_stable"}

    def start(self, num_blocks, block_size):
        self.m = BlockManager(num_blocks, block_size, fault=self.fault)

    def hash(self, parent, tokens, extra):
        return self.m.block_hash(parent, tokens, extra)

    def lookup(self, hashes):
        return self.m.cached_prefix(hashes)

    def allocate(self, req, block_hash, hit=None):
        return self.m.allocate(block_hash, hit)

    def free(self, req, blocks):
        self.m.free(blocks)

    def evict(self, block):
        return self.m.evict(block)

    def decode_append(self, req, block, token, block_hash):
        self.m.append_token(block, token, block_hash)
