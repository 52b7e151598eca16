// LIRS (Jiang & Zhang, SIGMETRICS 2002): the rule of epqlab/routes/policy_lirs.py (the simulator),
// line for line; that file's docstring states it and how the pager's constraints shape it.
//
// Invariant: at most lir_n = capacity - h experts are LIR; every resident non-LIR expert is in Q
// (oldest first) and nothing else is; S's bottom entry is always LIR (prune), so an expert found
// in S on a request had a reuse distance below the oldest LIR's recency and is promoted. A victim
// is Q's oldest evictable entry, else the least recent evictable LIR expert; pinned or too-small
// entries are passed over, never moved.
#include "policy_queues.h"

#include <algorithm>

namespace {

struct lirs final : queue_policy {
    unit_lists S, Q;             // S: the LIRS stack (first = bottom, least recent); Q: resident HIR, oldest first
    std::vector<uint8_t> lir, res;
    int64_t h, lir_n, n_lir = 0;
    lirs(int64_t c, size_t n, double hir_ratio) : S(n, 1), Q(n, 1), lir(n, 0), res(n, 0) {
        h = std::max<int64_t>(1, (int64_t) (hir_ratio * (double) c));
        lir_n = std::max<int64_t>(0, c - h);
    }
    void prune() {
        for (int b = S.lists[0].first; b >= 0 && !lir[b]; b = S.lists[0].first) S.erase(b);
    }
    void demote() {
        for (int b = S.lists[0].first; b >= 0; b = S.next[b]) {
            if (!lir[b]) continue;
            lir[b] = 0;
            n_lir--;
            if (res[b]) Q.push(0, b);
            return;
        }
    }
    void request(int u, bool resident) override {
        if (lir[u]) {
            const bool bottom = S.lists[0].first == u;
            S.to_newest(u);
            if (bottom) prune();
            return;
        }
        const bool in_s = S.in(0, u);
        S.erase(u);
        S.push(0, u);
        if (in_s || n_lir < lir_n) {
            lir[u] = 1;
            n_lir++;
            Q.erase(u);
            while (n_lir > lir_n) demote();
            prune();
        } else if (resident) {
            Q.to_newest(u);
        }
    }
    void insert(int u) override {
        res[u] = 1;
        if (!lir[u]) Q.push(0, u);
    }
    int victim(int, const std::function<bool(int)> & ok) override {
        const int v = Q.first_ok(0, ok);
        if (v >= 0) return v;
        for (int x = S.lists[0].first; x >= 0; x = S.next[x])
            if (lir[x] && ok(x)) return x;
        return -1;
    }
    void evicted(int v) override {
        res[v] = 0;
        Q.erase(v);
        if (lir[v]) {
            lir[v] = 0;
            n_lir--;
            prune();
        }
    }
    void dropped(int v) override {
        res[v] = 0;
        Q.erase(v);
        S.erase(v);
        if (lir[v]) {
            lir[v] = 0;
            n_lir--;
        }
        prune();
    }
};

}  // namespace

std::unique_ptr<queue_policy> make_lirs_policy(int64_t capacity, size_t n_units, double hir_ratio) {
    return std::make_unique<lirs>(capacity, n_units, hir_ratio);
}
