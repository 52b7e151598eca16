// lazy_load: redirects libllama's PLT/GOT entries for mmap and posix_madvise during a model
// load (lazy_load.h states the invariant).
//
// Invariant kept here: one scope at a time (a mutex held for the scope's life); a scope starts
// only when both mmap and posix_madvise relocations were found, and every GOT entry it changed is
// restored (its page re-protected where it lies in RELRO) when it ends or when starting it fails
// halfway. The wrappers change only the MAP_POPULATE flag and POSIX_MADV_WILLNEED advice, and
// record each file mapping libllama makes.
#include "lazy_load.h"

#include <cstring>
#include <elf.h>
#include <link.h>
#include <mutex>
#include <stdexcept>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace {

struct got_slot {
    void **      addr;
    void *       orig;
    std::string  name;
    bool         relro;
};

std::mutex                g_scope_mu;  // one scope at a time (held for the scope's lifetime)
std::vector<file_mapping> g_maps;
int64_t                   g_populates = 0;
int64_t                   g_willneeds = 0;

void * wrap_mmap(void * addr, size_t len, int prot, int flags, int fd, off_t off) {
    if (fd >= 0 && (flags & MAP_POPULATE)) {
        flags &= ~MAP_POPULATE;
        g_populates++;
    }
    void * r = mmap(addr, len, prot, flags, fd, off);
    if (r != MAP_FAILED && fd >= 0) {
        struct stat st{};
        fstat(fd, &st);
        g_maps.push_back(file_mapping{r, (int64_t) len, (int64_t) off, fd, (uint64_t) st.st_dev, (uint64_t) st.st_ino});
    }
    return r;
}

int wrap_posix_madvise(void * addr, size_t len, int advice) {
    if (advice == POSIX_MADV_WILLNEED) {
        g_willneeds++;
        return 0;
    }
    return posix_madvise(addr, len, advice);
}

bool is_target(const char * name) {
    return strcmp(name, "mmap") == 0 || strcmp(name, "mmap64") == 0 || strcmp(name, "posix_madvise") == 0;
}

#if defined(__x86_64__)
constexpr unsigned R_JUMP_SLOT = R_X86_64_JUMP_SLOT, R_GLOB_DAT = R_X86_64_GLOB_DAT;
#elif defined(__aarch64__)
constexpr unsigned R_JUMP_SLOT = R_AARCH64_JUMP_SLOT, R_GLOB_DAT = R_AARCH64_GLOB_DAT;
#else
#error "lazy_load supports x86-64 and aarch64"
#endif

struct find_ctx {
    const char *          lib;
    bool                  found = false;
    std::string           path;
    std::vector<got_slot> slots;
};

int on_object(dl_phdr_info * info, size_t, void * data) {
    auto * c = (find_ctx *) data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, c->lib)) return 0;
    c->found = true;
    c->path = info->dlpi_name;
    const uintptr_t base = info->dlpi_addr;
    const ElfW(Dyn) * dyn = nullptr;
    uintptr_t relro_lo = 0, relro_hi = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const auto & ph = info->dlpi_phdr[i];
        if (ph.p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *) (base + ph.p_vaddr);
        if (ph.p_type == PT_GNU_RELRO) {
            relro_lo = base + ph.p_vaddr;
            relro_hi = relro_lo + ph.p_memsz;
        }
    }
    if (!dyn) return 1;
    // glibc relocates these d_ptr values in place; older or other loaders may not.
    auto abs = [&](uintptr_t p) { return p < base ? p + base : p; };
    uintptr_t jmprel = 0, rela = 0, symtab = 0, strtab = 0;
    size_t jmprel_sz = 0, rela_sz = 0;
    int64_t pltrel = DT_RELA;
    for (const ElfW(Dyn) * d = dyn; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
            case DT_JMPREL:   jmprel = abs(d->d_un.d_ptr); break;
            case DT_PLTRELSZ: jmprel_sz = d->d_un.d_val; break;
            case DT_PLTREL:   pltrel = (int64_t) d->d_un.d_val; break;
            case DT_RELA:     rela = abs(d->d_un.d_ptr); break;
            case DT_RELASZ:   rela_sz = d->d_un.d_val; break;
            case DT_SYMTAB:   symtab = abs(d->d_un.d_ptr); break;
            case DT_STRTAB:   strtab = abs(d->d_un.d_ptr); break;
            default: break;
        }
    }
    if (!symtab || !strtab || pltrel != DT_RELA) return 1;
    const auto * syms = (const ElfW(Sym) *) symtab;
    const char * strs = (const char *) strtab;
    auto scan = [&](uintptr_t tab, size_t sz, unsigned want) {
        const auto * r = (const ElfW(Rela) *) tab;
        for (size_t i = 0; tab && i < sz / sizeof(ElfW(Rela)); i++) {
            if (ELF64_R_TYPE(r[i].r_info) != want) continue;
            const char * name = strs + syms[ELF64_R_SYM(r[i].r_info)].st_name;
            if (!is_target(name)) continue;
            const uintptr_t a = base + r[i].r_offset;
            c->slots.push_back(got_slot{(void **) a, nullptr, name, a >= relro_lo && a < relro_hi});
        }
    };
    scan(jmprel, jmprel_sz, R_JUMP_SLOT);
    scan(rela, rela_sz, R_GLOB_DAT);  // built with -fno-plt: calls go through GLOB_DAT entries
    return 1;
}

find_ctx find_slots(const char * lib) {
    find_ctx c;
    c.lib = lib;
    dl_iterate_phdr(on_object, &c);
    return c;
}

std::string missing(const find_ctx & c) {
    if (!c.found) return std::string(c.lib) + " is not loaded in this process";
    bool has_mmap = false, has_madvise = false;
    for (const auto & s : c.slots) {
        has_mmap |= s.name == "mmap" || s.name == "mmap64";
        has_madvise |= s.name == "posix_madvise";
    }
    if (has_mmap && has_madvise) return "";
    return c.path + " has no " + (has_mmap ? "" : "mmap ") + (has_madvise ? "" : "posix_madvise ") +
           "PLT/GOT relocation (llama.cpp other than the pinned 0.3.36 build?); use dense_weights=\"mmap\"";
}

void set_slot(const got_slot & s, void * value) {
    const long ps = sysconf(_SC_PAGESIZE);
    void * page = (void *) ((uintptr_t) s.addr & ~(uintptr_t) (ps - 1));
    if (mprotect(page, (size_t) ps, PROT_READ | PROT_WRITE) != 0)
        throw std::runtime_error("cannot make the GOT entry of " + s.name + " writable: " + strerror(errno));
    __atomic_store_n(s.addr, value, __ATOMIC_SEQ_CST);
    if (s.relro) mprotect(page, (size_t) ps, PROT_READ);
}

std::vector<got_slot> g_slots;

}  // namespace

std::string lazy_load_check(const char * lib) { return missing(find_slots(lib)); }

lazy_load_scope::lazy_load_scope(const char * lib) {
    g_scope_mu.lock();
    find_ctx c = find_slots(lib);
    const std::string why = missing(c);
    if (!why.empty()) {
        g_scope_mu.unlock();
        throw std::runtime_error("cannot load without the whole-file read: " + why);
    }
    g_maps.clear();
    g_populates = g_willneeds = 0;
    g_slots = c.slots;
    size_t done = 0;
    try {
        for (auto & s : g_slots) {
            s.orig = __atomic_load_n(s.addr, __ATOMIC_SEQ_CST);
            set_slot(s, s.name == "posix_madvise" ? (void *) &wrap_posix_madvise : (void *) &wrap_mmap);
            done++;
        }
    } catch (...) {
        for (size_t i = 0; i < done; i++) set_slot(g_slots[i], g_slots[i].orig);
        g_slots.clear();
        g_scope_mu.unlock();
        throw;
    }
}

lazy_load_scope::~lazy_load_scope() {
    for (auto & s : g_slots) {
        try { set_slot(s, s.orig); } catch (...) {}
    }
    g_slots.clear();
    g_scope_mu.unlock();
}

const std::vector<file_mapping> & lazy_load_scope::mappings() const { return g_maps; }
int64_t lazy_load_scope::populates_stripped() const { return g_populates; }
int64_t lazy_load_scope::willneeds_skipped() const { return g_willneeds; }
