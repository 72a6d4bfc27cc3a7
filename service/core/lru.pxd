# Declarations of lru.py's compiled functions, so that prefix_index.py calls them from C (cimport).
cpdef lru_push(int[:, ::1] lru, const long long[::1] pages)
cpdef Py_ssize_t acquire(int[:, ::1] lru, int[::1] ref_count, list pages, unsigned int[::1] out)
cpdef Py_ssize_t check_lru(int[:, ::1] lru)
