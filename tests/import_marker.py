"""A module whose import leaves a mark: a stream entry naming it must never get it imported
(tests/integration/test_actor.py). The mark is a file named by LUDIC_TEST_IMPORT_MARK."""

import os
from pathlib import Path

_mark = os.environ.get("LUDIC_TEST_IMPORT_MARK")
if _mark:
    Path(_mark).write_text("imported")


class Env:  # what the entry names
    pass
