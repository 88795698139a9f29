"""Make docs/report.png, the README's picture of the job report: runs jobs/sample.yaml into a temporary directory
(with a machine price, for tokens per dollar) and renders its _report.html in headless Chromium (tests/chromium.py).

    python dev/report_screenshot.py [--cost-per-hour 2.5] [--out docs/report.png] [--height 1800]
"""
from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import chromium
    from PIL import Image

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost-per-hour", default="2.5")
    parser.add_argument("--out", default=str(ROOT / "docs" / "report.png"))
    parser.add_argument("--height", type=int, default=1800, help="crop the page to this many pixels from the top")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sample"
        subprocess.run([sys.executable, "-m", "batchgen", "run", str(ROOT / "jobs" / "sample.yaml"), "--quiet",
                        "--set", f"output.path={out}", "--cost-per-hour", args.cost_per_hour], check=True, cwd=ROOT)
        shot = chromium.check_page(str(out / "_report.html"), screenshot=True).screenshot
    image = Image.open(io.BytesIO(shot))
    image.crop((0, 0, image.width, min(image.height, args.height))).save(args.out, optimize=True)
    print(args.out)


if __name__ == "__main__":
    main()
