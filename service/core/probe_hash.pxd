# Declarations of probe_hash.py's compiled functions, so that prefix_index.py calls them from C (cimport).
cdef long long nh(const unsigned int *seed, const unsigned char *parent, const unsigned char *page, Py_ssize_t n)
cpdef check_seed(const unsigned int[::1] seed, Py_ssize_t key_len)
