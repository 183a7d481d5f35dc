"""Text generation from a trained model: sample one byte at a time.

Each new byte is drawn from softmax(logits / temperature) restricted to the top_k most likely bytes,
conditioned on the last seq_len bytes. Uses the serial forward pass (no key/value cache: clarity first).
"""
import numpy as np

from hsgd.model import serial
from hsgd.model.backend import array_module, to_numpy


def generate(params, cfg, prompt, n_new, seed=0, temperature=0.8, top_k=40):
    """`prompt` (bytes) followed by `n_new` sampled bytes."""
    xp = array_module(params["wte"])
    rng = np.random.default_rng(seed)
    out = list(prompt) or [ord("\n")]
    for _ in range(n_new):
        ctx = np.array(out[-cfg.seq_len:], dtype=np.int64)[None, :]          # (1, T')
        logits, _ = serial.forward(params, xp.asarray(ctx), cfg)            # (1, T', V)
        z = to_numpy(logits[0, -1]).astype(np.float64) / max(temperature, 1e-6)
        if top_k and top_k < z.size:
            z[z < np.sort(z)[-top_k]] = -np.inf
        p = np.exp(z - z.max())
        out.append(int(rng.choice(z.size, p=p / p.sum())))
    return bytes(out)


def sample_text(text):
    """Bytes as text for a terminal: invalid UTF-8 replaced, control characters other than newline and tab shown
    as '?'."""
    s = text.decode("utf-8", errors="replace")
    return "".join(c if c in "\n\t" or c.isprintable() else "?" for c in s)
