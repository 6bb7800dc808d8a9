import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(items):
    """A learning test is a slow test too: `-m "not slow"` skips it."""
    for item in items:
        if item.get_closest_marker("learning"):
            item.add_marker("slow")
