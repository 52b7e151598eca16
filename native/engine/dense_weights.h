// dense_weights: llama.cpp's non-expert tensors held in anonymous memory, not the page cache.
//
// Invariant: each non-expert byte range of llama's own file mapping is replaced *in place* --
// same virtual addresses, so every tensor pointer llama holds stays valid -- by private
// anonymous pages that hold exactly the file's bytes: the pages are mapped read-write, filled
// with pread (O_DIRECT where the file system allows it, so the read leaves nothing in the page
// cache), then made read-only. Ranges are widened to whole pages; a page shared with an expert
// tensor carries bytes nobody reads through this mapping (the hook reads experts from the
// pager's region). This runs right after the load, before any tensor is read, so no
// computation ever sees the file-backed pages (docs/DESIGN.md §5 "Memory accounting"). A page llama.cpp
// no longer maps (it unmaps the file's head and tail past its first and last loaded tensor) is never
// mapped here: it is not llama's to read, and nobody would unmap it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "lazy_load.h"

struct dense_report {
    int64_t bytes = 0;       // anonymous bytes now holding dense weights (whole pages)
    int64_t bytes_read = 0;  // bytes read from the file for them
    int64_t ranges = 0;      // merged page ranges
    int64_t bytes_unmapped = 0;  // bytes of dense ranges (whole pages) llama.cpp had unmapped: not loaded, left alone
    bool    direct = false;  // read with O_DIRECT
    bool    locked = false;  // mlock'ed
    double  seconds = 0.0;
};

// The (file offset begin, end) pieces of `map` that are still mapped from its file now (/proc/self/maps: same
// device and inode, inside map's addresses).
std::vector<std::pair<int64_t, int64_t>> still_mapped(const file_mapping & map);

// ranges: (file offset, bytes) of every non-expert tensor. map: llama's mapping of the file. Only the pages still
// mapped from the file (still_mapped) are replaced; the rest are counted in bytes_unmapped.
// lock: mlock the copies; on failure throws std::runtime_error naming RLIMIT_MEMLOCK and the
// bytes needed. Throws std::runtime_error on a failed or short read (the mapping is then left
// partly anonymous: the caller must free the model).
dense_report dense_to_anon(const std::string & path, const file_mapping & map,
                           std::vector<std::pair<int64_t, int64_t>> ranges, bool lock);
