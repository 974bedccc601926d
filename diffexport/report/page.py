"""A Report as one self-contained HTML page: inline CSS, plots inlined as PNG data URIs, no script,
no network (a Content-Security-Policy that allows nothing else). Every string from the model, the
artifact or the check is escaped: a folder from a stranger can name its files anything."""

from __future__ import annotations

import base64
import html
import math

from diffexport.analysis import plots
from diffexport.report.build import Report

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 68em; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.5em 0; } td, th { border: 1px solid #ddd; padding: 0.2em 0.6em;
  text-align: left; vertical-align: top; } th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre, code { background: #f6f6f6; font-size: 0.85em; } pre { padding: 0.6em; overflow-x: auto; }
.pass { color: #0a0; font-weight: bold; } .fail { color: #c00; font-weight: bold; }
img.plot { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.note { color: #555; font-size: 0.9em; }
"""

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _table(rows, head=None, numeric=()) -> str:
    out = ["<table>"]
    if head:
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td{' class=num' if i in numeric else ''}>{cell}</td>"
                                    for i, cell in enumerate(row)) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _facts(pairs) -> str:
    """A two-column table of (label, value) with both escaped."""
    return _table([(_e(k), _e(v)) for k, v in pairs])


def _image(png: bytes, alt: str) -> str:
    return f'<img class="plot" alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'


def _verdict(verdict: bool | str) -> str:
    """PASS, FAIL (a bool: passed or not) or a check's verdict, INCONCLUSIVE among them: a check
    that could not have failed is never shown as a PASS."""
    verdict = verdict if isinstance(verdict, str) else "PASS" if verdict else "FAIL"
    css = {"PASS": "pass", "FAIL": "fail"}.get(verdict, "fail")
    return f'<span class="{css}">{_e(verdict)}</span>'


def _rate(value: float) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:,.1f}"


# ------------------------------------------------------------------------------------------ plots

def _lambda_plot(lambdas) -> bytes:

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.0), layout="constrained")
    layers = [layer for layer, _, _ in lambdas]
    ax.plot(layers, [init for _, init, _ in lambdas], marker="o", linestyle="--", label="lambda_init")
    if all(lam is not None for _, _, lam in lambdas):
        ax.plot(layers, [lam for _, _, lam in lambdas], marker="o", label="lambda (learned)")
    ax.set(xlabel="layer", ylabel="lambda", title="lambda per layer")
    ax.set_xticks(layers if len(layers) <= 16 else layers[::max(1, len(layers) // 16)])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return plots.figure_png(fig)


def _prefill_plot(comparisons) -> bytes:
    """One bar per comparison: the largest error beside its bound (or KL beside the budget)."""

    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(8.0, 0.35 * len(comparisons) + 1.2), layout="constrained")
    names = [c.name.strip() for _, c in comparisons]
    quantised = hasattr(comparisons[0][1], "budget")
    got = [(c.mean_kl if quantised and c.mean_kl is not None else c.max_abs) for _, c in comparisons]
    bound = [(c.budget.max_kl if quantised and c.mean_kl is not None else c.bound) for _, c in comparisons]
    rows = range(len(comparisons))
    ax.barh([r + 0.2 for r in rows], [max(g, 1e-30) for g in got], height=0.4,
            label="KL" if quantised else "max |error|")
    ax.barh([r - 0.2 for r in rows], [max(b, 1e-30) for b in bound], height=0.4,
            label="budget" if quantised else "bound",
            color="C3", alpha=0.6)
    ax.set_yticks(list(rows), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set(title="each output against its bound")
    ax.legend(fontsize=8)
    return plots.figure_png(fig)


def _speed_plot(speed) -> bytes:

    plt = plots.pyplot()
    labels, values, colors = ["prompt (prefill)"], [speed.prompt_tokens_per_s], ["C0"]
    if math.isfinite(speed.decode_tokens_per_s):
        labels += ["decode", "decode bound"]
        values += [speed.decode_tokens_per_s, speed.decode_bound]
        colors += ["C1", "C3"]
    fig, ax = plt.subplots(figsize=(6.4, 0.5 * len(labels) + 1.2), layout="constrained")
    ax.barh(labels, values, color=colors)
    ax.invert_yaxis()
    ax.set(xlabel="tokens/s", title=f"{speed.runtime}, batch 1, median of {speed.rounds} rounds")
    ax.grid(alpha=0.3, axis="x")
    return plots.figure_png(fig)


# ------------------------------------------------------------------------------------------ sections

def _model_section(report: Report) -> str:
    m = report.model
    pairs = [("family", m["family"]), ("source", f"{m['source']} {m['path'] or ''}".strip()),
             ("preset", m["preset"] or "(no exact match)"), ("parameters", f"{m['parameters']:,}"),
             ("layers", m["layers"]), ("d_model / ffn / vocab", f"{m['d_model']} / {m['ffn']} / {m['vocab']}"),
             ("heads", m["heads"]), ("RoPE", m["rope"])]
    if m["head_norm"]:
        pairs.append(("head norm", m["head_norm"]))
    parts = ["<h2>Model</h2>", _facts(pairs)]
    if m["lambdas"]:
        rows = [(str(layer), f"{init:.4f}", "(shape only)" if lam is None else f"{lam:.4f}")
                for layer, init, lam in m["lambdas"]]
        parts += [_table(rows, ("layer", "lambda_init", "lambda"), numeric=(0, 1, 2)),
                  _image(_lambda_plot(m["lambdas"]), "lambda per layer")]
    elif m["lambda_note"]:
        parts.append(f"<p>lambda: {_e(m['lambda_note'])}</p>")
    return "\n".join(parts)


def _artifact_section(report: Report) -> str:
    a = report.artifact_facts
    kind = (f"KV-cache decoder folder ({a['decoder_format'] or 'diffattention'} format)" if report.kind == "decoder"
            else "prefill ONNX file")
    pairs = [("artifact", report.artifact), ("kind", kind), ("dtype", a["dtype"]),
             ("DiffAttention op version", a["op_version"]),
             ("opsets", ", ".join(f"{d} {v}" for d, v in a["opsets"].items())),
             ("producer", a["producer"] or "?"), ("nodes", a["nodes"]),
             ("DiffAttention nodes", len(a["diff_attention"])),
             ("weights", f"{a['weights']['parameters']:,} values, {a['weights']['bytes'] / 1e6:.1f} MB"),
             ("quantisation", "; ".join(a["quantisation"]))]
    if a["decoder_folder"]:
        pairs.append(("context length", f"{a['decoder_folder']['context_length']:,} tokens"))
        pairs.append(("providers", ", ".join(a["decoder_folder"]["providers"])))
    pairs += [(f"runs in {runtime}", verdict) for runtime, verdict in a["runtimes"].items()]
    files = [(_e(name), f"{size:,}" if kind_ == "file" else "", _e(kind_)) for name, size, kind_ in a["files"]]
    total = sum(size for _, size, _ in a["files"])
    return "\n".join(["<h2>Artifact</h2>", _facts(pairs),
                      f"<p>Files ({total / 1e6:.1f} MB in all):</p>",
                      _table(files, ("file", "bytes", "what"), numeric=(1,))])


def _check_section(report: Report) -> str:
    check, measures = report.check, report.check.measures
    comparisons = check.comparisons
    passed = sum(c.passed for _, c in comparisons)
    rows = [("verdict", _verdict(check.verdict)),
            ("comparisons within their bound", f"{passed}/{len(comparisons)}")]
    distributions = [c for _, c in comparisons if hasattr(c, "budget") and c.mean_kl is not None]
    if distributions:
        worst = max(distributions, key=lambda c: c.mean_kl)
        rows.append(("KL against the budget", _e(f"largest mean KL {worst.mean_kl:.3g} nats "
                                                 f"(budget {worst.budget.max_kl:g}: {worst.budget.what}), "
                                                 f"lowest top-1 agreement {min(c.top1 for c in distributions):.1%}")))
        why = ("quantised weights change the function, so the budget judges the distributions (KL) and "
               "top-1 agreement and greedy tokens are reported, not judged")
        if report.model.get("source") == "preset":
            why += ("; this model has random weights, whose next-token distributions are near flat: there the "
                    "likeliest token changes with the smallest error, so low agreement says little (a trained "
                    "model, e.g. --preset diff-text-tiny, shows what quantisation does to one)")
        rows.append(("why agreement is not judged", _e(why)))
    elif comparisons:
        worst = max((c for _, c in comparisons), key=lambda c: c.max_abs / max(c.bound, 1e-30))
        rows.append(("closest to its bound", _e(f"{worst.name.strip()}: max |error| {worst.max_abs:.3g} of "
                                                f"{worst.bound:.3g} ({worst.max_abs / max(worst.bound, 1e-30):.0%}), "
                                                f"cosine {worst.cosine:.7f}")))
    if "greedy" in measures:
        agree, total = measures["greedy"]
        judged = _verdict(agree == total) if measures.get("greedy_judged") else "(reported: a quantised model)"
        rows.append(("greedy tokens == eager", f"{agree}/{total} steps {judged}"))
    if "transformers_greedy" in measures:
        rows.append(("transformers generate() == eager", _verdict(measures["transformers_greedy"])))
    for name, value in measures.get("perplexity", {}).items():
        rows.append((f"perplexity, {_e(name)}", f"{value:.3f}"))
    parts = ["<h2>Check against the eager reference</h2>", _table(rows)]
    steps = measures.get("decode_steps")
    if steps:

        fig = plots.decode_steps_figure([c for _, c in comparisons[:steps]],
                                        f"{report.artifact.name}: every decode step against eager")
        parts.append(_image(plots.figure_png(fig), "error per decode step against its bound"))
    elif comparisons:
        parts.append(_image(_prefill_plot(comparisons), "each output against its bound"))
    parts.append("<p>The check's own report:</p><pre>" + _e(check.text()) + "</pre>")
    return "\n".join(parts)


def _speed_section(report: Report) -> str:
    speed = report.speed
    if speed is None:
        return "<h2>Speed</h2><p>Not measured (--no-speed).</p>"
    rows = [("runtime", _e(f"{speed.runtime}, {speed.threads} threads")),
            ("prompt", _e(f"{speed.prompt_tokens} tokens at {_rate(speed.prompt_tokens_per_s)} tokens/s "
                          f"(rounds {_rate(speed.prompt_spread[0])} to {_rate(speed.prompt_spread[1])})"))]
    if math.isfinite(speed.decode_tokens_per_s):
        share = speed.decode_tokens_per_s / speed.decode_bound if speed.decode_bound else float("nan")
        rows += [("decode", _e(f"{speed.new_tokens} tokens at {_rate(speed.decode_tokens_per_s)} tokens/s "
                               f"(rounds {_rate(speed.decode_spread[0])} to {_rate(speed.decode_spread[1])})")),
                 ("memory-bandwidth estimate", _e(f"{_rate(speed.decode_bound)} tokens/s: "
                                                  f"{speed.weight_bytes / 1e6:.1f} MB "
                                                 "of weights read per token at the probe's "
                                                 f"{speed.read_bytes_per_s / 1e9:.1f} "
                                                 f"GB/s; decode runs at {share:.0%} of it"))]
    else:
        rows.append(("memory-bandwidth estimate", _e(f"a prefill file has no decode; its weights "
                                                  f"({speed.weight_bytes / 1e6:.1f} MB) read at "
                                                  f"{speed.read_bytes_per_s / 1e9:.1f} GB/s would bound a decode "
                                                  f"step at {_rate(speed.decode_bound)} tokens/s")))
    note = ("<p class=note>Measured on this machine when the page was made: batch 1, greedy, a seeded random "
            "prompt, medians after a warm-up. Read bandwidth: onnxruntime's own GEMV over 512 MiB of float32, "
            "median of a probe before and one after the rounds. The estimate is weight bytes per token over that "
            "bandwidth: an estimate, not a bound: weights that fit in the CPU's caches (a small model) are read "
            "faster than the probe's 512 MiB, and decode can then beat it.</p>")
    return "\n".join(["<h2>Speed on this machine</h2>", _table(rows), _image(_speed_plot(speed), "tokens per second"),
                      note])


def _commands_section(report: Report) -> str:
    rows = [(_e(what), f"<code>{_e(command)}</code>") for what, command in report.commands]
    return "\n".join(["<h2>Reproduce</h2>", _table(rows, ("what", "command"))])


def render_html(report: Report) -> str:
    title = f"diffexport report: {report.artifact.name}"
    head = (f"<p>{_verdict(report.check.verdict)} &middot; made {_e(report.created)} by diffexport "
            f"{_e(report.version)} on {_e(report.machine)}</p>")
    body = [f"<h1>{_e(title)}</h1>", head, _model_section(report), _artifact_section(report),
            _check_section(report), _speed_section(report), _commands_section(report)]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">\n"
            f"<title>{_e(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")
