"""The loss curve of a build (`loss.jsonl`) as a small SVG line plot (no plotting library)."""

from __future__ import annotations

import json
from pathlib import Path

W, H, PAD = 640, 320, 48
SERIES = (("loss", "next token", "#1f77b4"), ("mtp_loss", "MTP: token after next", "#d62728"))


def device_of(log: Path) -> str:
    """The GPU of the build whose loss log is `log`, from its record beside it
    (`loss.jsonl` -> `build.json`, `run4-loss.jsonl` -> `run4-build.json`), else 'a GPU'."""
    record = log.with_name(log.name.replace("loss.jsonl", "build.json"))
    if record != log and record.is_file():
        return "an " + json.loads(record.read_text()).get("device", "unnamed GPU")
    return "a GPU"


def write_svg(log: Path, out: Path) -> None:
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in rows]
    top = max(max(r[k] for r in rows) for k, _, _ in SERIES)

    def x(step: float) -> float:
        return PAD + (W - 2 * PAD) * step / max(steps)

    def y(v: float) -> float:
        return H - PAD - (H - 2 * PAD) * v / top

    parts = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         'font-family="sans-serif" font-size="12">'),
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
        (f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">optimizer step '
         f"({max(steps):,} steps, {rows[-1]['seconds']:.0f} s on {device_of(log)})</text>"),
        (f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">'
         "cross-entropy (nats, reply tokens)</text>"),
    ]
    for v in range(int(top) + 1):
        parts.append(f'<text x="{PAD - 6}" y="{y(v) + 4}" text-anchor="end">{v}</text>')
    for i, (key, label, color) in enumerate(SERIES):
        pts = " ".join(f"{x(r['step']):.1f},{y(r[key]):.1f}" for r in rows)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        parts.append(f'<text x="{W - PAD - 170}" y="{PAD + 16 * i}" fill="{color}">{label}: '
                     f"{rows[-1][key]:.2f}</text>")
    parts.append("</svg>")
    out.write_text("\n".join(parts) + "\n")
