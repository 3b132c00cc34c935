"""Assemble README.md from the per-area sections in docs/readme/ (edit those, then run this)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ["_head", "trainer", "kernels-rope-router", "kernels-moe", "overrides", "qwen3", "nkisim",
         "cost-model", "benchmarks", "_tail"]


def main() -> None:
    parts = []
    for name in ORDER:
        path = ROOT / "docs" / "readme" / f"{name}.md"
        if path.exists():
            parts.append(path.read_text().strip() + "\n")
    (ROOT / "README.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
