"""An independent float64 oracle of the DiffAttention contract, in NumPy with explicit head loops.

It shares no code with diffexport.kernel.reference: it re-reads the layout from the contract's words
(maps 2h/2h+1 of diff-head h; V1 keys 2g/2g+1 of kv-group g; diff-head h reads g = h // (H/Hkv);
bottom-right causal alignment).
"""

import numpy as np


def softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=-1, keepdims=True)


def diff_attention_oracle(query, key, value, lambda_full, norm_weight, key_mask=None, *, variant, num_heads,
                          num_kv_heads, head_dim, causal, scale=0.0, norm=1, norm_eps=1e-5, output_scale=1.0):
    """key_mask [B, Skv]: 1 = key present, 0 = padding; a query row that sees no key gives zeros."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (query, key, value))
    lam_all = np.asarray(lambda_full, dtype=np.float64)
    B, Sq, _ = q.shape
    Skv = k.shape[1]
    H, Hkv, D = num_heads, num_kv_heads, head_dim
    Dv = 2 * D if variant == 1 else D
    s = scale if scale > 0 else 1.0 / np.sqrt(D)
    visible = np.ones((Sq, Skv), dtype=bool)
    if causal:  # row i sees keys 0 .. i + Skv - Sq; none where that is negative (more queries than keys)
        for i in range(Sq):
            visible[i, max(0, i + (Skv - Sq) + 1):] = False
    out = np.empty((B, Sq, H * Dv))
    for b in range(B):
        seen = visible if key_mask is None else visible & (np.asarray(key_mask)[b] != 0)[None, :]
        for h in range(H):
            g = h // (H // Hkv)
            q1 = q[b, :, (2 * h) * D:(2 * h + 1) * D]
            q2 = q[b, :, (2 * h + 1) * D:(2 * h + 2) * D]
            if variant == 1:
                k1 = k[b, :, (2 * g) * D:(2 * g + 1) * D]
                k2 = k[b, :, (2 * g + 1) * D:(2 * g + 2) * D]
            else:
                k1 = k2 = k[b, :, g * D:(g + 1) * D]
            vg = v[b, :, g * Dv:(g + 1) * Dv]
            a1, a2 = (np.zeros((Sq, Skv)) for _ in range(2))
            rows = seen.any(axis=1)
            a1[rows] = softmax(np.where(seen, s * q1 @ k1.T, -np.inf)[rows])
            a2[rows] = softmax(np.where(seen, s * q2 @ k2.T, -np.inf)[rows])
            lam = lam_all.reshape(()) if variant == 1 else lam_all[b, :, h][:, None]
            o = (a1 - lam * a2) @ vg
            if norm:
                o = o / np.sqrt((o ** 2).mean(axis=-1, keepdims=True) + norm_eps)
            if norm_weight is not None:  # per-channel weight, after the norm or alone
                o = o * np.asarray(norm_weight, dtype=np.float64)
            out[b, :, h * Dv:(h + 1) * Dv] = o * output_scale
    return out
