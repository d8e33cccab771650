"""A/B of the 64-head Gluon decode: one program a (request, split) vs persistent programs that
start the next item's query and key tiles under the current one's; copies-only and MMAs-only parts
of the persistent one; small batches (splits > 1) both ways."""

import functools
import sys
sys.path.insert(0, "bench")
sys.argv = ["x"]
import dsv4_attention as b
from sglang_dsv41.attention import dsv4_gluon_decode as g
from sglang_dsv41.attention.dsv4_triton_decode import DecodeTiles, dsv4_decode_triton
copy_bw = b.copy_bandwidth()
cache, table_, lens, q, sinks, comp, picks = b.decode_inputs(512, 8192, 64, 64)
launch = g.launch
for persistent in (False, True):
    g.PERSISTENT = persistent
    for config in [(64, 64, 8, 2, 0, True), (64, 32, 8, 3, 0, True), (64, 32, 8, 4, 0, True)]:
        tiles = DecodeTiles(*config)
        for parts in (0, 1, 2):
            if parts and (not persistent or config[1] != 64):
                continue
            g.launch = functools.partial(launch, parts=parts)
            row = []
            for kind, idx in picks.items():
                def run():
                    return dsv4_decode_triton(q, cache, table_, lens, sinks, b.W, b.D ** -0.5,
                                              comp if idx is not None else None, idx, tiles=tiles)
                us = b.decode_timer(run)
                pct = 100 * b.decode_bytes(q, idx) / us / 1e3 / copy_bw
                row.append(f"{kind} {us:6.1f} us {pct:4.1f}%")
            print(f"persistent={persistent} {config} parts={parts}: " + "; ".join(row), flush=True)
g.launch = launch
# small batch: splits > 1 through the persistent kernel
for batch in (8, 64):
    cache, table_, lens, q, sinks, comp, picks = b.decode_inputs(batch, 8192, 64, 64)
    for persistent in (False, True):
        g.PERSISTENT = persistent
        row = []
        for kind, idx in picks.items():
            def run():
                return dsv4_decode_triton(q, cache, table_, lens, sinks, b.W, b.D ** -0.5,
                                          comp if idx is not None else None, idx)
            row.append(f"{kind} {b.decode_timer(run):6.1f} us")
        print(f"batch {batch} persistent={persistent}: " + "; ".join(row), flush=True)
