// The queue-based policies; each mirrors its class in epqlab/routes/policy_queues.py /
// policy_tinylfu.py line for line (see policy_queues.h).
#include "policy_queues.h"

#include <algorithm>
#include <array>
#include <stdexcept>

void unit_lists::push(int l, int u) {
    list & L = lists[l];
    which[u] = (int8_t) l;
    prev[u] = L.last;
    next[u] = -1;
    if (L.last >= 0) next[L.last] = u;
    else L.first = u;
    L.last = u;
    L.n++;
}

void unit_lists::erase(int u) {
    const int l = which[u];
    if (l < 0) return;
    list & L = lists[l];
    if (prev[u] >= 0) next[prev[u]] = next[u];
    else L.first = next[u];
    if (next[u] >= 0) prev[next[u]] = prev[u];
    else L.last = prev[u];
    prev[u] = next[u] = -1;
    which[u] = -1;
    L.n--;
}

int unit_lists::pop_oldest(int l) {
    const int u = lists[l].first;
    if (u >= 0) erase(u);
    return u;
}

int unit_lists::first_ok(int l, const std::function<bool(int)> & ok) const {
    for (int u = lists[l].first; u >= 0; u = next[u])
        if (ok(u)) return u;
    return -1;
}

namespace {

double param(const std::map<std::string, double> & p, const char * name) {
    auto it = p.find(name);
    if (it == p.end()) throw std::invalid_argument(std::string("missing policy parameter ") + name);
    return it->second;
}

// ARC (Megiddo & Modha, FAST 2003).
struct arc final : queue_policy {
    enum { T1, T2, B1, B2 };
    unit_lists q;
    int64_t c, target = 0;
    arc(int64_t cap, size_t n) : q(n, 4), c(cap) {}
    void request(int u, bool resident) override {
        if (resident) { q.erase(u); q.push(T2, u); }
    }
    void admit(int u) override {
        const int64_t b1 = q.size(B1), b2 = q.size(B2);
        if (q.in(B1, u)) target = std::min(c, target + std::max<int64_t>(1, b2 / b1));
        else if (q.in(B2, u)) target = std::max<int64_t>(0, target - std::max<int64_t>(1, b1 / b2));
    }
    int victim(int u, const std::function<bool(int)> & ok) override {
        const int a = q.first_ok(T1, ok), b = q.first_ok(T2, ok);
        const int64_t n1 = q.size(T1);
        const bool from_t1 = n1 >= 1 && ((q.in(B2, u) && n1 == target) || n1 > target);
        return ((from_t1 && a >= 0) || b < 0) ? a : b;
    }
    void evicted(int v) override {
        const bool t1 = q.in(T1, v);
        q.erase(v);
        q.push(t1 ? B1 : B2, v);
    }
    void dropped(int v) override { q.erase(v); }
    void insert(int u) override {
        if (q.in(B1, u) || q.in(B2, u)) { q.erase(u); q.push(T2, u); }
        else q.push(T1, u);
        while (q.size(T1) + q.size(B1) > c && q.size(B1)) q.pop_oldest(B1);
        while (q.size(T1) + q.size(T2) + q.size(B1) + q.size(B2) > 2 * c && (q.size(B2) || q.size(B1)))
            q.pop_oldest(q.size(B2) ? B2 : B1);
    }
};

// 2Q, full version (Johnson & Shasha, VLDB 1994).
struct twoq final : queue_policy {
    enum { A1IN, A1OUT, AM };
    unit_lists q;
    int64_t kin, kout;
    bool stage = false;  // admit = stage: a miss not in A1out is staged, its id put in A1out
    twoq(int64_t c, size_t n, double fin, double fout, bool stage_refused)
        : q(n, 3), kin(std::max<int64_t>(1, (int64_t) (fin * (double) c))), kout(std::max<int64_t>(1, (int64_t) (fout * (double) c))),
          stage(stage_refused) {}
    bool stages() const override { return stage; }
    bool refuse(int u, const std::function<bool(int)> &) override { return stage && !q.in(A1OUT, u); }
    void refused(int u) override {
        q.push(A1OUT, u);
        while (q.size(A1OUT) > kout) q.pop_oldest(A1OUT);
    }
    void request(int u, bool resident) override {
        if (resident && q.in(AM, u)) q.to_newest(u);
    }
    int victim(int, const std::function<bool(int)> & ok) override {
        if (q.size(A1IN) > kin) {
            const int v = q.first_ok(A1IN, ok);
            return v >= 0 ? v : q.first_ok(AM, ok);
        }
        const int v = q.first_ok(AM, ok);
        return v >= 0 ? v : q.first_ok(A1IN, ok);
    }
    void evicted(int v) override {
        if (q.in(A1IN, v)) {
            q.erase(v);
            q.push(A1OUT, v);
            while (q.size(A1OUT) > kout) q.pop_oldest(A1OUT);
        } else {
            q.erase(v);
        }
    }
    void dropped(int v) override { q.erase(v); }
    void insert(int u) override {
        if (q.in(A1OUT, u)) { q.erase(u); q.push(AM, u); }
        else q.push(A1IN, u);
    }
};

// SIEVE (Zhang et al., NSDI 2024). The queue's oldest is its tail; "next" goes toward the head.
struct sieve final : queue_policy {
    unit_lists q;
    std::vector<uint8_t> visited;
    int hand = -1;  // -1: start at the tail
    sieve(size_t n) : q(n, 1), visited(n, 0) {}
    void request(int u, bool resident) override {
        if (resident) visited[u] = 1;
    }
    void insert(int u) override { q.push(0, u); visited[u] = 0; }
    int victim(int, const std::function<bool(int)> & ok) override {
        const int64_t n = q.size(0);
        int x = hand >= 0 ? hand : q.lists[0].first;
        for (int64_t i = 0; i < 2 * n + 1; i++) {
            if (x < 0) x = q.lists[0].first;
            if (ok(x)) {
                if (visited[x]) visited[x] = 0;
                else { hand = q.next[x]; return x; }
            }
            x = q.next[x];
        }
        return -1;
    }
    void evicted(int v) override {
        if (hand == v) hand = q.next[v];
        q.erase(v);
        visited[v] = 0;
    }
    void dropped(int v) override { evicted(v); }
};

// S3-FIFO (Yang et al., SOSP 2023).
struct s3fifo final : queue_policy {
    enum { S, M, G };
    unit_lists q;
    std::vector<uint8_t> freq;
    int64_t s_n, g_n;
    int thr;
    bool stage = false;  // admit = stage: a miss not in G is staged, its id put in G
    s3fifo(int64_t c, size_t n, double small, double ghost, int threshold, bool stage_refused)
        : q(n, 3), freq(n, 0), s_n(std::max<int64_t>(1, (int64_t) (small * (double) c))),
          g_n(std::max<int64_t>(1, (int64_t) (ghost * (double) c))), thr(threshold), stage(stage_refused) {}
    bool stages() const override { return stage; }
    bool refuse(int u, const std::function<bool(int)> &) override { return stage && !q.in(G, u); }
    void refused(int u) override {
        q.push(G, u);
        while (q.size(G) > g_n) q.pop_oldest(G);
    }
    void request(int u, bool resident) override {
        if (resident) freq[u] = (uint8_t) std::min(freq[u] + 1, 3);
    }
    void insert(int u) override {
        if (q.in(G, u)) { q.erase(u); q.push(M, u); }
        else q.push(S, u);
        freq[u] = 0;
    }
    int victim(int, const std::function<bool(int)> & ok) override {
        if (q.size(S) >= s_n) {
            for (;;) {
                const int t = q.first_ok(S, ok);
                if (t < 0) break;
                if (freq[t] >= thr) { q.erase(t); q.push(M, t); continue; }
                return t;
            }
        }
        for (;;) {
            const int t = q.first_ok(M, ok);
            if (t < 0) break;
            if (freq[t] > 0) { freq[t]--; q.to_newest(t); continue; }
            return t;
        }
        return q.first_ok(S, ok);
    }
    void evicted(int v) override {
        if (q.in(S, v)) {
            q.erase(v);
            q.push(G, v);
            while (q.size(G) > g_n) q.pop_oldest(G);
        } else {
            q.erase(v);
        }
        freq[v] = 0;
    }
    void dropped(int v) override {
        if (!q.in(G, v)) q.erase(v);
        freq[v] = 0;
    }
};

// W-TinyLFU (Einziger, Friedman & Manes, ACM TOS 2017) with the count-min sketch of policy_tinylfu.py.
struct wtinylfu final : queue_policy {
    enum { W, P, R };
    static constexpr std::array<uint64_t, 4> SEEDS = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full,
                                                      0x165667B19E3779F9ull, 0xD6E8FEB86659FD93ull};
    unit_lists q;
    int64_t w_n, m_n, r_n, width = 16, sample, n_added = 0;
    std::array<std::vector<uint8_t>, 4> rows;
    bool stage = false;  // admit = stage (policy_params.py's index 1)
    wtinylfu(int64_t c, size_t n, double window, double prot, int64_t factor, bool stage_refused)
        : q(n, 3), stage(stage_refused) {
        w_n = std::max<int64_t>(1, (int64_t) (window * (double) c));
        m_n = std::max<int64_t>(0, c - w_n);
        r_n = std::max<int64_t>(1, (int64_t) (prot * (double) m_n));
        while (width < c) width *= 2;
        sample = factor * c;
        for (auto & r : rows) r.assign((size_t) width, 0);
    }
    int64_t idx(int i, int u) const { return (int64_t) ((((uint64_t) (u + 1) * SEEDS[i]) >> 32) & (uint64_t) (width - 1)); }
    void add(int u) {
        for (int i = 0; i < 4; i++) {
            uint8_t & x = rows[i][idx(i, u)];
            if (x < 15) x++;
        }
        if (++n_added >= sample) {
            for (auto & r : rows) for (auto & x : r) x >>= 1;
            n_added /= 2;
        }
    }
    int estimate(int u) const {
        int m = 15;
        for (int i = 0; i < 4; i++) m = std::min<int>(m, rows[i][idx(i, u)]);
        return m;
    }
    void request(int u, bool resident) override {
        add(u);
        if (!resident) return;
        if (q.in(W, u) || q.in(R, u)) q.to_newest(u);
        else if (q.in(P, u)) {
            q.erase(u);
            q.push(R, u);
            if (q.size(R) > r_n) q.push(P, q.pop_oldest(R));
        }
    }
    void insert(int u) override {
        q.push(W, u);
        while (q.size(W) > w_n && q.size(P) + q.size(R) < m_n) q.push(P, q.pop_oldest(W));
    }
    int victim(int, const std::function<bool(int)> & ok) override {
        for (;;) {
            int cm = q.first_ok(P, ok);
            if (cm < 0) cm = q.first_ok(R, ok);
            const int cw = q.size(W) >= w_n ? q.first_ok(W, ok) : -1;
            if (cw < 0) return cm >= 0 ? cm : q.first_ok(W, ok);
            if (q.size(P) + q.size(R) < m_n) { q.erase(cw); q.push(P, cw); continue; }
            if (cm < 0) return cw;
            if (estimate(cw) > estimate(cm)) { q.erase(cw); q.push(P, cw); return cm; }
            return cw;
        }
    }
    void evicted(int v) override { q.erase(v); }
    void dropped(int v) override { q.erase(v); }
    bool stages() const override { return stage; }
    // TinyLFU at the door: the miss must be rated strictly more frequent than main's victim.
    bool refuse(int u, const std::function<bool(int)> & ok) override {
        if (!stage) return false;
        int cm = q.first_ok(P, ok);
        if (cm < 0) cm = q.first_ok(R, ok);
        return cm >= 0 && estimate(u) <= estimate(cm);
    }
};

}  // namespace

std::unique_ptr<queue_policy> make_queue_policy(const std::string & policy, int64_t c, size_t n,
                                                const std::map<std::string, double> & p, int n_expert) {
    if (policy == "coact") return make_coact_policy(n, n_expert);
    if (policy == "lirs") return make_lirs_policy(c, n, param(p, "hir_ratio"));
    if (policy == "arc") return std::make_unique<arc>(c, n);
    const bool stage = p.count("admit") && p.at("admit") == 1.0;  // admit = stage (policy_params.py's index 1)
    if (policy == "2q") return std::make_unique<twoq>(c, n, param(p, "kin"), param(p, "kout"), stage);
    if (policy == "sieve") return std::make_unique<sieve>(n);
    if (policy == "s3fifo")
        return std::make_unique<s3fifo>(c, n, param(p, "small_ratio"), param(p, "ghost_ratio"), (int) param(p, "move_threshold"), stage);
    if (policy == "wtinylfu")
        return std::make_unique<wtinylfu>(c, n, param(p, "window"), param(p, "protected"), (int64_t) param(p, "sample_factor"), stage);
    return nullptr;
}
