"""The routes of ``ludic inference``, one module per concern."""
