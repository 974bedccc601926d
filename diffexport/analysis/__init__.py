"""Deployment analysis: attention-logit statistics, low-bit logit sweeps, the needle retrieval task."""
