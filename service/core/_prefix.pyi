# Types of the compiled module service/core/_prefix.c (definitions: service/core/prefix_index.py).
import numpy as np

SHA256_IMPL: str

def sha256(data: bytes | memoryview, /) -> bytes: ...
def commit(
    table: np.ndarray,
    keys: np.ndarray,
    key_hash: np.ndarray,
    hashes: np.ndarray,
    is_hashed: np.ndarray,
    pages: np.ndarray,
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: int,
    /,
) -> bytes: ...
def match(
    table: np.ndarray,
    keys: np.ndarray | None,
    key_hash: np.ndarray,
    hashes: np.ndarray,
    parent: bytes,
    data: bytes | memoryview,
    page_nbytes: int,
    /,
) -> tuple[list[int], bytes]: ...
def lru_push(lru: np.ndarray, pages: np.ndarray, /) -> None: ...
def lru_remove(lru: np.ndarray, pages: np.ndarray, /) -> None: ...
def evict(
    lru: np.ndarray, table: np.ndarray, key_hash: np.ndarray, is_hashed: np.ndarray, num: int, /
) -> list[int]: ...
def int64_bytes(token_ids: list[int], /) -> bytes: ...
