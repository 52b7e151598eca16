// coact: co-activation-aware eviction; the rule of epqlab/routes/policy_coact.py (see there).
#include "policy_queues.h"

#include <tuple>

namespace {

struct coact final : queue_policy {
    int E;
    std::vector<int64_t> C;       // [unit][expert of its layer]: steps holding both
    std::vector<int64_t> P, cnt;  // partner mass over resident units; requests so far
    std::vector<uint64_t> last;
    std::vector<uint8_t> res;
    std::vector<int32_t> residents;  // resident units (any order: the victim is a minimum)
    uint64_t tick = 0;
    coact(size_t n, int n_expert) : E(n_expert), C(n * n_expert, 0), P(n, 0), cnt(n, 0), last(n, 0), res(n, 0) {}
    void router(int li, const std::vector<int32_t> & picked) override {
        const int b = li * E;
        for (int32_t e : picked)
            for (int32_t f : picked)
                if (e != f) {
                    C[(size_t) (b + e) * E + f]++;
                    if (res[b + f]) P[b + e]++;
                }
    }
    void request(int u, bool) override {
        last[u] = ++tick;
        cnt[u]++;
    }
    void column(int u, int64_t sign) {
        const int b = u - u % E, e = u % E;
        for (int f = 0; f < E; f++)
            if (f != e) P[b + f] += sign * C[(size_t) (b + f) * E + e];
    }
    void insert(int u) override {
        res[u] = 1;
        residents.push_back(u);
        column(u, 1);
    }
    void evicted(int u) override {
        if (!res[u]) return;
        res[u] = 0;
        for (size_t i = 0; i < residents.size(); i++)
            if (residents[i] == u) { residents[i] = residents.back(); residents.pop_back(); break; }
        column(u, -1);
    }
    void dropped(int u) override { evicted(u); }
    int victim(int, const std::function<bool(int)> & ok) override {
        int best = -1;
        std::tuple<int64_t, uint64_t, int> bk;
        for (int v : residents) {
            if (!ok(v)) continue;
            const auto kv = std::make_tuple(cnt[v] + P[v], last[v], v);
            if (best < 0 || kv < bk) { best = v; bk = kv; }
        }
        return best;
    }
};

}  // namespace

std::unique_ptr<queue_policy> make_coact_policy(size_t n_units, int n_expert) {
    return std::make_unique<coact>(n_units, n_expert);
}
