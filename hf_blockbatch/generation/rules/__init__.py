"""Transfer rules beyond the built-in threshold / factor / quota ones (see ``transfer.py``).

Each module holds one rule as a pure tensor function on padded ``[A, W]`` scores plus a small
frozen dataclass of its options; the registry that names them for the configs lives elsewhere.
"""
