"""Shared checks of kvstack's forward pass against llama.cpp (llama-cpp-python).

Used by test_llamacpp_parity.py (SmolLM2) and test_gemma3_parity.py (Gemma 3);
each test file documents its yardstick. Not a test module itself.
"""
import pathlib
import tempfile

import numpy as np

from conftest import THREADS, run_kvstack


def llama_logits(llama, ids):
    """llama.cpp's logits for every position of ids: float32 [len(ids), n_vocab]."""
    llama.reset()
    llama.eval(ids)
    return np.array(llama.scores[: len(ids)], dtype=np.float32)


def kvstack_logits(ids, *model_args):
    """kvstack logits for every position of ids; model_args e.g. ("-m", path)."""
    with tempfile.TemporaryDirectory() as d:
        out = pathlib.Path(d) / "logits.npy"
        run_kvstack("logits", *model_args, "--tokens", ",".join(map(str, ids)), "--out", out,
                    "--threads", THREADS)
        return np.load(out)


def top2_gap(row):
    """Logit gap between the best and second-best token of one row."""
    part = np.partition(row, -2)
    return float(part[-1] - part[-2])


def llama_greedy(llama, ids, n):
    """n greedy tokens from llama.cpp after ids, and the top-2 gap at each step."""
    llama.reset()
    llama.eval(ids)
    out, gaps = [], []
    for _ in range(n):
        row = np.array(llama.scores[llama.n_tokens - 1], dtype=np.float32)
        tok = int(row.argmax())
        out.append(tok)
        gaps.append(top2_gap(row))
        llama.eval([tok])
    return out, gaps


def check_logits(name, ids, ref, alt, got):
    """Asserts kvstack's logits got stay within llama.cpp's own spread |alt - ref|.

    ref: llama.cpp default settings, alt: llama.cpp with flash attention, both
    [len(ids), n_vocab]. Every top-1 difference must be a near-tie (llama.cpp's
    top-2 gap below twice its own disagreement at that position); mean abs error
    at most (1.25 + 1/sqrt(n))x and max abs error at most 1.5x the spread.
    """
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    diff = np.abs(got - ref)
    spread = np.abs(alt - ref)
    rel = diff.max() / np.abs(ref).max()
    print(f"\n[{name}] {len(ids)} tokens: kvstack vs llama.cpp max abs err {diff.max():.4f}, "
          f"mean {diff.mean():.5f}, max rel {rel:.2e}, top-1 differs at "
          f"{(ref.argmax(1) != got.argmax(1)).sum()} positions; llama.cpp flash on/off: max "
          f"{spread.max():.4f}, mean {spread.mean():.5f}, top-1 differs at "
          f"{(ref.argmax(1) != alt.argmax(1)).sum()} positions")
    ref_top = ref.argmax(axis=1)
    got_top = got.argmax(axis=1)
    for pos in np.nonzero(ref_top != got_top)[0]:
        gap = top2_gap(ref[pos])
        print(f"[{name}] position {pos}: top-1 differs (llama.cpp {ref_top[pos]}, kvstack "
              f"{got_top[pos]}), llama.cpp top-2 gap {gap:.4f}, llama.cpp flash on/off "
              f"disagreement there {spread[pos].max():.4f}")
        noise = float(spread[pos].max())
        assert gap < 2 * noise, (f"top-1 differs at position {pos} without a near-tie (gap {gap}, "
                                 f"llama.cpp's own disagreement there {noise})")
    # A real bug (positions, masking, GQA mapping, RoPE) shows up as errors of
    # several logits everywhere, far outside llama.cpp's own spread.
    # The mean over a short prompt is a small sample of rounding noise (the
    # 5-token prompt has 4 positions that differ at all), so the bound widens
    # by the usual 1/sqrt(n) of a sample mean: 1.70x at 5 tokens, 1.28x at 1K.
    bound = 1.25 + 1.0 / np.sqrt(len(ids))
    assert diff.mean() <= bound * spread.mean(), "mean error beyond llama.cpp's own spread"
    assert diff.max() <= 1.5 * spread.max(), "max error beyond llama.cpp's own spread"


def check_greedy(name, ref, gaps, got, n, near_tie):
    """Asserts kvstack's n greedy tokens got equal llama.cpp's ref, a divergence
    accepted only at a step where llama.cpp's top-2 gap is below near_tie."""
    assert len(got) == n
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            print(f"\n[{name}] greedy diverges at step {i}: llama.cpp {a}, kvstack {b}, "
                  f"llama.cpp top-2 gap {gaps[i]:.4f}")
            assert gaps[i] < near_tie, f"divergence at step {i} without a near-tie"
            return
    print(f"\n[{name}] greedy: {n} identical tokens")
