"""Write ``docs/capabilities.md``, the capability matrix, from ``tests/test_capabilities.py``.

Run ``python docs/_scripts/capabilities.py`` after changing the tables of that test module
(in the test environment: it imports the test suite's backend helpers). The test suite
fails while the committed page differs from what this writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    import test_capabilities

    test_capabilities.PAGE.write_text(test_capabilities.render_page(), encoding="utf-8")
    print(f"wrote {test_capabilities.PAGE.relative_to(ROOT)}")
