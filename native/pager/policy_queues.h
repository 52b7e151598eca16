// Queue-based eviction policies of the pager: arc, 2q, sieve, s3fifo, wtinylfu (and coact, a scan of
// the residents: policy_coact.cpp; lirs: policy_lirs.cpp). Each is the rule of
// epqlab/routes/policy_queues.py and policy_tinylfu.py (the simulators; papers cited there), which the
// tests hold to the same hits, misses and evictions on the same trace. Units are the pager's ids
// (layer index * n_expert + expert); c is the arena's slot count.
//
// The pager calls, for every request (in request order) request(u, resident); for every miss, when
// it is about to get a slot, admit(u), then victim(u, ok) only when no slot is free, then insert(u);
// evicted(v) when v loses its slot as a victim (ghosts are recorded), dropped(v) when v gives its
// slot back without being a victim (a failed read). A prefetched unit enters like a miss (admit,
// victim, insert) without a request; its first demand request is an ordinary hit.
// victim() returns a unit with ok(unit) (resident, unpinned, not in flight, slot large enough) or -1;
// a scan passes over units that are not ok without changing them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

// Intrusive doubly linked lists over unit ids; each unit is in at most one list.
struct unit_lists {
    struct list { int32_t first = -1, last = -1; int64_t n = 0; };  // first = oldest
    std::vector<int32_t> prev, next;
    std::vector<int8_t>  which;  // list index, -1 = none
    std::vector<list>    lists;
    unit_lists(size_t n_units, int n_lists) : prev(n_units, -1), next(n_units, -1), which(n_units, -1), lists(n_lists) {}
    bool in(int l, int u) const { return which[u] == l; }
    int64_t size(int l) const { return lists[l].n; }
    void push(int l, int u);   // as the newest of list l
    void erase(int u);         // from whatever list holds it (no-op if none)
    int  pop_oldest(int l);    // -1 if empty
    void to_newest(int u) { const int l = which[u]; erase(u); push(l, u); }
    int  first_ok(int l, const std::function<bool(int)> & ok) const;
};

struct queue_policy {
    virtual ~queue_policy() = default;
    virtual void request(int u, bool resident) = 0;
    virtual void admit(int) {}
    // After layer li's router ran: the step's distinct experts, sorted (before its requests; staged steps too).
    virtual void router(int /*li*/, const std::vector<int32_t> & /*picked*/) {}
    virtual int  victim(int u, const std::function<bool(int)> & ok) = 0;
    virtual void insert(int u) = 0;
    virtual void evicted(int u) = 0;
    virtual void dropped(int u) = 0;
    // Admission staging (issue 50's admission knob, wtinylfu's admit = stage): stages() says the policy may
    // refuse a miss a slot; refuse(u, ok), asked only when no slot is free for u (after admit), says it does:
    // u is then read into the staging buffer for its layer step, takes no slot, evicts nothing and is not
    // inserted. ok as for victim().
    virtual bool stages() const { return false; }
    virtual bool refuse(int /*u*/, const std::function<bool(int)> & /*ok*/) { return false; }
    // A demand miss was refused (staged): 2Q and S3-FIFO remember it as a ghost, so its next miss is
    // admitted (refuse() itself changes nothing: a prefetch asks it too).
    virtual void refused(int /*u*/) {}
};

// policy: "arc" | "2q" | "sieve" | "s3fifo" | "wtinylfu"; params as epqlab.routes.policy_params fills them
// (every parameter present). Returns null for any other policy name.
std::unique_ptr<queue_policy> make_queue_policy(const std::string & policy, int64_t capacity, size_t n_units,
                                                const std::map<std::string, double> & params, int n_expert);
std::unique_ptr<queue_policy> make_coact_policy(size_t n_units, int n_expert);  // policy_coact.cpp
std::unique_ptr<queue_policy> make_lirs_policy(int64_t capacity, size_t n_units, double hir_ratio);  // policy_lirs.cpp
