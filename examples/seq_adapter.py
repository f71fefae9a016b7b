"""kvcheck adapter for examples/seq_manager.py (a sequence-level manager), on the sequence-level
shape of kvcheck's hash-chain base class (docs/adapters.md, "A sequence-level manager").

    kvcheck adapter-check examples.seq_adapter:Adapter --config examples/seq.json
    kvcheck fuzz --sut examples.seq_adapter:Adapter --config examples/seq.json --budget 60s
    kvcheck fuzz --sut examples.seq_adapter:Adapter --config examples/seq.json --fault key_without_prefix
"""
from kvcheck.engines.hashchain.sequence import SequenceAdapter

from examples.seq_manager import SeqManager


class Adapter(SequenceAdapter):
    name = "seq-example"
    # planted bug -> the check that must catch it (`--fault NAME`)
    faults = {"key_without_prefix": "hit_sound_content"}

    def start(self, num_blocks, block_size):
        self.m = SeqManager(num_blocks, block_size, bug=self.fault)

    def lookup(self, tokens):
        return self.m.match(tokens)

    def admit(self, seq, tokens):
        return self.m.admit(seq, tokens)

    def append(self, seq, tokens):
        return self.m.extend(seq, tokens)

    def free(self, seq):
        self.m.release(seq)
