"""A model-free extraction run through FeatureStore, for crash, resume and scale-out tests.

    python tests/_selftest.py OUT --samples 200            # one process
    torchrun --nproc_per_node 2 tests/_selftest.py OUT --samples 200 --dist   # gloo, CPU

Every sample's features derive from a RNG seeded by its id alone, so any run, interrupted or not, on any
number of ranks, must produce the same bytes per id. The input has repeated ids and some ids that "fail"
(recorded as errors), like real data. One line per sample goes to stdout ("added <k>") so a test can kill
the process at a chosen point of progress; ``--crash-after K`` exits hard (no flush) after K samples.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Sequence

import torch

from vlfast.extraction.store.format import DUPLICATE_KIND
from vlfast.extraction.store.resume import duplicate_reason, plan_positions
from vlfast.extraction.store.writer import FeatureStore, dist_info

RUN_CONFIG = {"model": "selftest", "dtype": "bfloat16", "features": ["tokens", "mean", "deep", "grid_thw"]}


def sample_ids(n: int) -> list[str]:
    """n distinct ids plus a repeat of every 25th one, appended where a real manifest might repeat it."""
    ids = [f"clip-{i:05d}" for i in range(n)]
    return ids + [ids[i] for i in range(3, n, 25)]


def fails(sample_id: str) -> bool:
    """Deterministic "bad input": about one id in 23 cannot be decoded."""
    return _seed(sample_id) % 23 == 0


def _seed(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(sample_id.encode(), digest_size=8).digest(), "big") >> 1


def fake_features(sample_id: str, dim: int = 64) -> dict[str, torch.Tensor]:
    """Variable-length features of several dtypes, like merged vision tokens, a pooled vector, deepstack."""
    g = torch.Generator().manual_seed(_seed(sample_id))
    n_tokens = 1 + int(torch.randint(0, 24, (1,), generator=g))
    tokens = torch.randn(n_tokens, dim, generator=g).to(torch.bfloat16)  # (L, D)
    return {
        "tokens": tokens,
        "mean": tokens.float().mean(0),  # (D,)
        "deep": torch.randn(2, n_tokens, 8, generator=g).to(torch.float16),  # (levels, L, 8)
        "grid_thw": torch.tensor([[1, 2, 2 * n_tokens]], dtype=torch.int64),  # (k, 3)
    }


def run(
    out: str,
    n: int,
    *,
    dim: int = 64,
    sleep: float = 0.0,
    shard_max_samples: int = 8,
    crash_after: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    verbose: bool = False,
    compact_every: int | None = None,
    compact_min_parts: int | None = 8,
) -> int:
    """Extract the fake dataset into ``out`` (resuming); returns the number of samples handled."""
    ids: Sequence[str] = sample_ids(n)
    with FeatureStore(
        out,
        RUN_CONFIG | {"dim": dim},
        rank=rank,
        world_size=world_size,
        shard_max_samples=shard_max_samples,
        compact_min_parts=compact_min_parts,
    ) as store:
        todo, repeats = plan_positions(ids, rank, world_size, store.done_ids())
        for k, first in repeats:  # what extract records for a repeated id
            store.add_error(ids[k], f"videos/{ids[k]}.mp4", duplicate_reason(k, first), kind=DUPLICATE_KIND)
        if verbose:
            print(f"pending {len(todo)}", flush=True)
        for k, pos in enumerate(todo):
            sid = ids[pos]
            if crash_after is not None and k == crash_after:
                if torch.distributed.is_initialized():
                    # Every rank reaches its crash point before any dies: the first rank to exit makes torchrun
                    # stop the others at once, wherever they are (on a loaded host, one can be between a
                    # shard's rename and its index part, or not have committed anything yet).
                    torch.distributed.barrier()
                os._exit(3)  # a crash: nothing buffered is flushed, no cleanup runs
            if fails(sid):
                store.add_error(sid, f"videos/{sid}.mp4", "decode failed: simulated corrupt file")
            else:
                feats = fake_features(sid, dim)
                store.add(sid, feats, {"path": f"videos/{sid}.mp4", "n_tokens": feats["tokens"].shape[0]})
            if verbose:
                print(f"added {k + 1}", flush=True)
            if compact_every and (k + 1) % compact_every == 0:
                if verbose:
                    print("compacting", flush=True)
                store.compact()
            if sleep:
                time.sleep(sleep)
    return len(todo)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _how(x: torch.Tensor, y: torch.Tensor, name: str, ca) -> str:
    """How two tensors of one shape differ: how many elements, by how much, and whether ``y`` is exactly
    another sample's ``name`` in ``ca`` (a row served for the wrong id, not arithmetic)."""
    fx, fy = x.float(), y.float()
    unequal = (fx != fy) & ~(fx.isnan() & fy.isnan())
    said = f"{int(unequal.sum())}/{x.numel()} elements, max |diff| {float((fx - fy).abs().nan_to_num().max()):.3g}"
    same_as = [sid for sid in ca.ids() if name in ca[sid] and _bytes(ca[sid][name]) == _bytes(y)]
    return said + (f"; equals {same_as[:3]} of the first" if same_as else "")


def compare_caches(a: str | os.PathLike, b: str | os.PathLike) -> list[str]:
    """Differences between two extraction folders, per sample: ids, and for each id every feature's dtype,
    shape and bytes, and its meta; then the error records (ignoring time and rank). Empty means equal.

    Shard boundaries, row numbers and which rank wrote a sample are deliberately not compared: a resumed
    or re-sharded run is equal to an uninterrupted one when every sample is.
    """
    from vlfast.extraction.store.reader import FeatureCache

    ca, cb = FeatureCache(a), FeatureCache(b)
    diffs: list[str] = []
    ids_a, ids_b = set(ca.ids()), set(cb.ids())
    if ids_a != ids_b:
        diffs.append(
            f"ids only in {a}: {sorted(ids_a - ids_b)[:5]}; only in {b}: {sorted(ids_b - ids_a)[:5]}"
        )
    for sid in sorted(ids_a & ids_b):
        fa, fb = ca[sid], cb[sid]
        if fa.keys() != fb.keys():
            diffs.append(f"{sid}: features {sorted(fa)} vs {sorted(fb)}")
            continue
        for name in fa:
            x, y = fa[name], fb[name]
            if x.dtype != y.dtype or x.shape != y.shape:
                diffs.append(f"{sid}/{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
            elif _bytes(x) != _bytes(y):
                diffs.append(f"{sid}/{name}: {x.dtype}{tuple(x.shape)}, bytes differ; {_how(x, y, name, ca)}")
        if ca.meta(sid) != cb.meta(sid):
            diffs.append(f"{sid}: meta {ca.meta(sid)} vs {cb.meta(sid)}")

    def errs(c):
        return sorted((e["id"], e["source"], e["reason"], e["kind"]) for e in c.errors())

    if errs(ca) != errs(cb):
        diffs.append(f"errors differ: {errs(ca)[:3]}... vs {errs(cb)[:3]}...")
    return diffs


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per sample, so kills land mid-run")
    p.add_argument("--shard-samples", type=int, default=8)
    p.add_argument(
        "--crash-after", type=int, default=None, help="exit 3 after K samples (with --dist: all ranks)"
    )
    p.add_argument("--compact-every", type=int, default=None, help="compact the index after every K samples")
    p.add_argument("--dist", action="store_true", help="init torch.distributed (gloo) from torchrun's env")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    if a.dist:
        torch.distributed.init_process_group("gloo")
    rank, world = dist_info()
    try:
        run(
            a.out,
            a.samples,
            dim=a.dim,
            sleep=a.sleep,
            shard_max_samples=a.shard_samples,
            crash_after=a.crash_after,
            rank=rank,
            world_size=world,
            verbose=a.verbose,
            compact_every=a.compact_every,
        )
        if a.dist:
            torch.distributed.barrier()  # every rank's shards are committed before anyone reports done
    finally:
        if a.dist:
            torch.distributed.destroy_process_group()
    if a.verbose:
        print(f"done rank {rank}/{world}", flush=True)


if __name__ == "__main__":
    main()
