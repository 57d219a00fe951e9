"""Loom's composition root: settings, the ``loom`` CLI and the wiring of the components.

No component imports this package; it imports them.
"""
