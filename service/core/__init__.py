"""Pure bookkeeping: allocator, sequences, lookup tables, errors (stdlib + numpy only)."""
