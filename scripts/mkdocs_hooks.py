"""mkdocs hook: the README is the site's home page, with its ``docs/...`` links made relative to docs/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    readme = Path(config["config_file_path"]).parent / "README.md"
    text = re.sub(r"\]\(docs/", "](", readme.read_text())
    files.append(File.generated(config, "index.md", content=text))
    return files
