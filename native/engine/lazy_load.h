// lazy_load: stock llama.cpp's model load without its whole-file read.
//
// Invariant: while a lazy_load_scope is alive, libllama's own calls to mmap and posix_madvise
// (resolved through its PLT: R_*_JUMP_SLOT relocations in its .got.plt) go to wrappers that
// clear MAP_POPULATE and skip POSIX_MADV_WILLNEED, and record every file mapping libllama
// makes. Nothing else about the loader changes: the same mapping, the same protections, the
// same tensor pointers, so the math is unchanged; pages are simply read on first touch instead
// of all at load. The original GOT entries are restored when the scope ends, also on
// exceptions. llama.cpp's source is never patched (docs/DESIGN.md §3b "Loading without the
// whole-file read"). If the relocations cannot be found (another libllama build, full RELRO
// that cannot be made writable), the scope refuses to start and says why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct file_mapping {
    void *  addr;    // start address returned by mmap
    int64_t length;  // bytes
    int64_t offset;  // file offset of addr, bytes
    int     fd;
    uint64_t dev, ino;  // identity of the mapped file (fstat at mmap time)
};

class lazy_load_scope {
public:
    // Finds and redirects the GOT entries of the shared object whose path contains `lib`
    // (default "libllama.so"). Throws std::runtime_error naming what is missing.
    explicit lazy_load_scope(const char * lib = "libllama.so");
    ~lazy_load_scope();
    lazy_load_scope(const lazy_load_scope &) = delete;
    lazy_load_scope & operator=(const lazy_load_scope &) = delete;

    // File mappings libllama made while the scope was alive (populate stripped).
    const std::vector<file_mapping> & mappings() const;
    // Number of MAP_POPULATE flags removed and WILLNEED advices skipped.
    int64_t populates_stripped() const;
    int64_t willneeds_skipped() const;
};

// Empty string when the relocations lazy_load_scope needs exist in `lib`, else the reason.
std::string lazy_load_check(const char * lib = "libllama.so");
