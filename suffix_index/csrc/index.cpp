// Suffix index core. See index.hpp and suffix_index/reference.py (the specification).
#include "index.hpp"

#include <algorithm>
#include <cstring>
#include <queue>
#include <stdexcept>

namespace suffix_index {

// ---------------------------------------------------------------------------------------------
// ChainedText

void ChainedText::init(int nmin, int nmax) {
    nmin_ = nmin;
    nmax_ = nmax;
    clear();
}

void ChainedText::clear() {
    tokens.clear();
    prev_.assign(size_t(nmax_ - nmin_ + 1), 0);  // e = 0 has no n-gram
    head_.assign(1024, 0);
    entries_ = 0;
}

uint64_t ChainedText::hash(const uint32_t* key, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ull * uint64_t(n + 1);
    for (int i = 0; i < n; ++i) {
        h ^= key[i];
        h *= 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
    }
    return h;
}

void ChainedText::index_at(size_t e) {
    // n-grams ending at e (tokens [e-n, e)), for every n that fits and contains no SEP
    const uint32_t* t = tokens.data();
    const size_t mask = head_.size() - 1;
    const size_t K = size_t(nmax_ - nmin_ + 1);
    prev_.resize((e + 1) * K, 0);
    for (int n = nmin_; n <= nmax_; ++n) {
        if (size_t(n) > e) continue;
        bool sep = false;
        for (int i = 1; i <= n; ++i) sep |= (t[e - i] == SEP);
        if (sep) continue;
        size_t id = e * K + size_t(n - nmin_);
        size_t b = size_t(hash(t + e - n, n)) & mask;
        prev_[id] = head_[b];
        head_[b] = uint32_t(id + 1);
        ++entries_;
    }
}

void ChainedText::rehash(size_t min_buckets) {
    size_t nb = 1024;
    while (nb < min_buckets) nb <<= 1;
    head_.assign(nb, 0);
    prev_.assign(size_t(nmax_ - nmin_ + 1), 0);
    entries_ = 0;
    for (size_t e = 1; e <= tokens.size(); ++e) index_at(e);
}

void ChainedText::push(uint32_t tok) {
    if (tokens.size() >= (size_t(1) << 30)) throw std::length_error("a text of over 2^30 tokens");
    tokens.push_back(tok);
    // keep the load (entries per bucket) at most 2
    if ((entries_ + size_t(nmax_ - nmin_ + 1)) > 2 * head_.size()) {
        rehash(head_.size() * 2);
    } else {
        index_at(tokens.size());
    }
}

void ChainedText::append(const uint32_t* toks, size_t n) {
    size_t want = tokens.size() + n;
    if (want >= (size_t(1) << 30)) throw std::length_error("a text of over 2^30 tokens");
    const size_t K = size_t(nmax_ - nmin_ + 1);
    if (tokens.capacity() < want) {
        tokens.reserve(want);
        prev_.reserve((want + 1) * K);
    }
    size_t need = (want * K + 1) / 2;
    if (need > head_.size()) {
        tokens.insert(tokens.end(), toks, toks + n);
        rehash(need);
        return;
    }
    for (size_t i = 0; i < n; ++i) push(toks[i]);
}

void ChainedText::shrink() {
    tokens.shrink_to_fit();
    prev_.shrink_to_fit();
}

size_t ChainedText::nbytes() const {
    return (tokens.capacity() + head_.capacity() + prev_.capacity()) * sizeof(uint32_t);
}

template <class F>
void ChainedText::walk(const uint32_t* key, int n, F&& f) const {
    const uint32_t* t = tokens.data();
    const size_t K = size_t(nmax_ - nmin_ + 1);
    const size_t k = size_t(n - nmin_);
    size_t b = size_t(hash(key, n)) & (head_.size() - 1);
    for (uint32_t id1 = head_[b]; id1 != 0; id1 = prev_[id1 - 1]) {
        size_t id = id1 - 1;
        if (id % K != k) continue;
        size_t e = id / K;
        if (std::memcmp(t + e - n, key, size_t(n) * sizeof(uint32_t)) != 0) continue;
        if (!f(e)) return;
    }
}

// ---------------------------------------------------------------------------------------------
// Index

Index::Index(const Params& p) : p_(p) {
    if (p_.min_ngram < 1 || p_.max_ngram < p_.min_ngram || p_.max_ngram > MAX_NGRAM_LIMIT)
        throw std::invalid_argument("need 1 <= min_ngram <= max_ngram <= 16");
}

Tenant& Index::tenant(const std::string& name) {
    auto it = tenants_.find(name);
    if (it != tenants_.end()) return *it->second;
    auto t = std::make_unique<Tenant>();
    t->arena.init(p_.min_ngram, p_.max_ngram);
    Tenant& ref = *t;
    tenants_.emplace(name, std::move(t));
    return ref;
}

Request& Index::req(const std::string& req_id) {
    auto it = reqs_.find(req_id);
    if (it == reqs_.end()) throw std::invalid_argument("unknown request id '" + req_id + "'");
    return *it->second;
}

void Index::start(const std::string& req_id, const uint32_t* prompt, size_t n, const std::string& tname) {
    if (reqs_.count(req_id)) throw std::invalid_argument("request '" + req_id + "' already started");
    check_tokens(prompt, n);
    Tenant& t = tenant(tname);
    auto r = std::make_unique<Request>();
    r->tenant = &t;
    r->tenant_name = tname;
    r->ctx.init(p_.min_ngram, p_.max_ngram);
    r->ctx.append(prompt, n);
    r->prompt_len = n;
    r->epoch = t.epoch;
    reqs_.emplace(req_id, std::move(r));
}

void Index::sync(Request& r) {
    if (r.epoch != r.tenant->epoch) {
        r.live.erase(std::remove_if(r.live.begin(), r.live.end(), [](const Candidate& c) { return c.src != REQ; }),
                     r.live.end());
        r.epoch = r.tenant->epoch;
    }
}

void Index::check_tokens(const uint32_t* toks, size_t n) const {
    uint32_t hi = 0;
    for (size_t i = 0; i < n; ++i) hi = std::max(hi, toks[i]);
    if (n && hi > p_.max_token)
        throw std::invalid_argument("token id " + std::to_string(hi) + " out of range [0, " +
                                    std::to_string(p_.max_token) + "]");
}

void Index::extend(const std::string& req_id, const uint32_t* toks, size_t n) {
    Request& r = req(req_id);
    check_tokens(toks, n);
    sync(r);
    const auto& arena = r.tenant->arena.tokens;
    for (size_t i = 0; i < n; ++i) {
        uint32_t tok = toks[i];
        size_t w = 0;
        const auto& ctx = r.ctx.tokens;
        for (size_t j = 0; j < r.live.size(); ++j) {
            Candidate c = r.live[j];
            const auto& text = c.src == REQ ? ctx : arena;
            if (c.pos < text.size() && text[c.pos] == tok) {
                c.pos += 1;
                c.agree = std::min(c.agree + 1, p_.max_agreement);
                r.live[w++] = c;
            }
        }
        r.live.resize(w);
        r.ctx.push(tok);
    }
}

void Index::stop(const std::string& req_id) {
    auto it = reqs_.find(req_id);
    if (it == reqs_.end()) throw std::invalid_argument("unknown request id '" + req_id + "'");
    Request& r = *it->second;
    if (p_.keep_outputs && r.ctx.size() > r.prompt_len) {
        Tenant& t = *r.tenant;
        t.serial += 1;
        std::string key = std::string(1, '\0') + "h" + std::to_string(t.serial);
        add_text(t, true, key, r.ctx.tokens.data() + r.prompt_len, r.ctx.size() - r.prompt_len);
        evict_history(t);
    }
    reqs_.erase(it);
}

int Index::agreement(const ChainedText& ctx, const std::vector<uint32_t>& text, size_t e, int n) const {
    int a = n;
    const size_t end = ctx.size();
    const uint32_t* c = ctx.tokens.data();
    const uint32_t* t = text.data();
    while (a < p_.max_agreement && e >= size_t(a) + 1 && end >= size_t(a) + 1) {
        uint32_t x = t[e - size_t(a) - 1];
        if (x == SEP || x != c[end - size_t(a) - 1]) break;
        ++a;
    }
    return std::min(a, p_.max_agreement);
}

static inline bool rank_less(const Candidate& a, const Candidate& b) {
    if (a.agree != b.agree) return a.agree > b.agree;
    if (a.src != b.src) return a.src < b.src;
    return a.pos > b.pos;
}

void Index::ranked_candidates(Request& r, std::vector<Candidate>& cands) {
    sync(r);
    cands = r.live;
    const ChainedText& ctx = r.ctx;
    const ChainedText& arena = r.tenant->arena;
    const size_t end = ctx.size();
    auto known = [&](int src, size_t pos) {
        for (const auto& c : cands)
            if (c.src == src && c.pos == pos) return true;
        return false;
    };
    const int top = int(std::min<size_t>(size_t(p_.max_ngram), end));
    uint32_t key[MAX_NGRAM_LIMIT];
    for (int n = top; n >= p_.min_ngram; --n) {
        std::memcpy(key, ctx.tokens.data() + end - size_t(n), size_t(n) * sizeof(uint32_t));
        int found = 0;
        ctx.walk(key, n, [&](size_t e) {
            if (e >= end) return true;  // the suffix itself
            if (found == p_.max_candidates) return false;
            ++found;
            if (!known(REQ, e)) cands.push_back({REQ, uint32_t(e), agreement(ctx, ctx.tokens, e, n)});
            return found < p_.max_candidates;
        });
        found = 0;
        const auto& at = arena.tokens;
        if (p_.max_candidates > 0) {
            arena.walk(key, n, [&](size_t e) {
                if (e >= at.size() || at[e] == SEP) return true;  // no continuation
                ++found;
                if (!known(ARENA, e)) cands.push_back({ARENA, uint32_t(e), agreement(ctx, at, e, n)});
                return found < p_.max_candidates;
            });
        }
        if (cands.size() >= size_t(std::max(1, p_.min_candidates))) break;
    }
    std::sort(cands.begin(), cands.end(), rank_less);
    r.live.assign(cands.begin(), cands.begin() + std::min<size_t>(cands.size(), size_t(p_.max_candidates)));
}

std::vector<Candidate> Index::candidates(const std::string& req_id) {
    std::vector<Candidate> out;
    ranked_candidates(req(req_id), out);
    return out;
}

DraftOut Index::propose(const std::string& req_id, int budget) {
    Request& r = req(req_id);
    if (budget <= 0) return {};
    std::vector<Candidate> cands;
    ranked_candidates(r, cands);
    if (cands.empty()) return {};
    return tree(r, cands, std::min<size_t>(cands.size(), size_t(p_.max_branches)), budget);
}

namespace {
struct Node {
    uint32_t tok;
    int32_t parent;
    int32_t first_child = -1;
    int32_t next_sibling = -1;
    double weight = 0.0;
};
struct HeapItem {
    double s;
    int32_t node;
    bool operator<(const HeapItem& o) const {  // max-heap on s, then the smaller node first
        if (s != o.s) return s < o.s;
        return node > o.node;
    }
};
}  // namespace

DraftOut Index::tree(const Request& r, const std::vector<Candidate>& cands, size_t k, int budget) const {
    DraftOut out;
    const int best = cands[0].agree;
    const double conf = 1.0 - 1.0 / (2.0 + double(best));
    const size_t depth = size_t(std::min(budget, std::max(p_.min_draft, 2 * best)));
    std::vector<Node> nodes;
    nodes.reserve(k * depth + 1);
    nodes.push_back({0u, -1});
    const auto& ctx = r.ctx.tokens;
    const auto& arena = r.tenant->arena.tokens;
    for (size_t ci = 0; ci < k; ++ci) {
        const Candidate& c = cands[ci];
        double w = double(int64_t(c.agree) * int64_t(c.agree)) * (c.src == ARENA ? p_.arena_weight : 1.0);
        const auto& text = c.src == REQ ? ctx : arena;
        int32_t node = 0;
        nodes[0].weight += w;
        size_t stop = std::min(text.size(), size_t(c.pos) + depth);
        for (size_t i = c.pos; i < stop; ++i) {
            uint32_t tok = text[i];
            if (tok == SEP) break;
            int32_t nxt = -1, last = -1;
            for (int32_t ch = nodes[size_t(node)].first_child; ch != -1; ch = nodes[size_t(ch)].next_sibling) {
                if (nodes[size_t(ch)].tok == tok) { nxt = ch; break; }
                last = ch;
            }
            if (nxt == -1) {
                nxt = int32_t(nodes.size());
                nodes.push_back({tok, node});
                if (last == -1) nodes[size_t(node)].first_child = nxt;
                else nodes[size_t(last)].next_sibling = nxt;
            }
            nodes[size_t(nxt)].weight += w;
            node = nxt;
        }
    }
    std::priority_queue<HeapItem> heap;
    const double w0 = nodes[0].weight;
    for (int32_t ch = nodes[0].first_child; ch != -1; ch = nodes[size_t(ch)].next_sibling)
        heap.push({conf * (nodes[size_t(ch)].weight / w0), ch});
    std::vector<int32_t> index_of(nodes.size(), -1);
    std::vector<double> survival(nodes.size(), 0.0);
    survival[0] = 1.0;
    while (!heap.empty() && int(out.tokens.size()) < budget) {
        HeapItem it = heap.top();
        heap.pop();
        if (it.s < p_.min_survival) break;
        const Node& nd = nodes[size_t(it.node)];
        index_of[size_t(it.node)] = int32_t(out.tokens.size());
        out.tokens.push_back(nd.tok);
        out.parents.push_back(nd.parent == 0 ? -1 : index_of[size_t(nd.parent)]);
        out.probs.push_back(conf * (nd.weight / nodes[size_t(nd.parent)].weight));
        survival[size_t(it.node)] = it.s;
        out.score += it.s;
        for (int32_t ch = nd.first_child; ch != -1; ch = nodes[size_t(ch)].next_sibling)
            heap.push({it.s * (conf * (nodes[size_t(ch)].weight / nd.weight)), ch});
    }
    return out;
}

// ---------------------------------------------------------------------------------------------
// Documents, history, compaction

void Index::add_text(Tenant& t, bool history, const std::string& key, const uint32_t* toks, size_t n) {
    uint32_t start = uint32_t(t.arena.size());
    t.texts.push_back({history, key, start, uint32_t(n)});
    t.by_key[key] = std::prev(t.texts.end());
    t.arena.append(toks, n);
    t.arena.push(SEP);
    if (history) t.history += int64_t(n);
}

void Index::kill(Tenant& t, const TextInfo& x) {
    auto& a = t.arena.tokens;
    std::fill(a.begin() + x.start, a.begin() + x.start + x.length + 1, SEP);
    t.dead += uint64_t(x.length) + 1;
    if (x.history) t.history -= int64_t(x.length);
}

void Index::evict_history(Tenant& t) {
    while (t.history > p_.history_tokens) {
        auto it = std::find_if(t.texts.begin(), t.texts.end(), [](const TextInfo& x) { return x.history; });
        if (it == t.texts.end()) break;
        kill(t, *it);
        t.by_key.erase(it->key);
        t.texts.erase(it);
    }
    maybe_compact(t);
}

void Index::maybe_compact(Tenant& t) {
    if (t.dead * 2 <= t.arena.size()) return;
    std::vector<uint32_t> old;
    old.swap(t.arena.tokens);
    std::vector<uint32_t> fresh;
    fresh.reserve(old.size() - t.dead);
    for (auto& x : t.texts) {
        uint32_t start = uint32_t(fresh.size());
        fresh.insert(fresh.end(), old.begin() + x.start, old.begin() + x.start + x.length);
        fresh.push_back(SEP);
        x.start = start;
    }
    t.arena.clear();
    t.arena.append(fresh.data(), fresh.size());
    t.arena.shrink();
    t.dead = 0;
    t.epoch += 1;
}

void Index::add_document(const std::string& doc_id, const uint32_t* toks, size_t n, const std::string& tname) {
    check_tokens(toks, n);
    if (doc_tenant_.count(doc_id)) remove_document(doc_id);
    Tenant& t = tenant(tname);
    add_text(t, false, doc_id, toks, n);
    doc_tenant_[doc_id] = tname;
}

bool Index::remove_document(const std::string& doc_id) {
    auto it = doc_tenant_.find(doc_id);
    if (it == doc_tenant_.end()) return false;
    Tenant& t = *tenants_.at(it->second);
    doc_tenant_.erase(it);
    auto k = t.by_key.find(doc_id);
    kill(t, *k->second);
    t.texts.erase(k->second);
    t.by_key.erase(k);
    maybe_compact(t);
    return true;
}

// ---------------------------------------------------------------------------------------------
// Accounting and snapshots

size_t Index::nbytes() const {
    size_t b = sizeof(Index);
    for (auto& [name, t] : tenants_) {
        b += sizeof(Tenant) + name.size() + t->arena.nbytes();
        for (auto& x : t->texts) b += sizeof(TextInfo) + x.key.size() + 48;  // list + map nodes
    }
    for (auto& [id, r] : reqs_) b += sizeof(Request) + id.size() + r->ctx.nbytes() + r->live.capacity() * sizeof(Candidate);
    for (auto& [d, t] : doc_tenant_) b += d.size() + t.size() + 64;
    return b;
}

size_t Index::request_tokens() const {
    size_t n = 0;
    for (auto& [id, r] : reqs_) n += r->ctx.size();
    return n;
}

size_t Index::arena_tokens() const {
    size_t n = 0;
    for (auto& [name, t] : tenants_)
        for (auto& x : t->texts) n += x.length;
    return n;
}

int64_t Index::history_tokens(const std::string& tname) const {
    auto it = tenants_.find(tname);
    return it == tenants_.end() ? 0 : it->second->history;
}

uint64_t Index::arena_size(const std::string& tname) const {
    auto it = tenants_.find(tname);
    return it == tenants_.end() ? 0 : it->second->arena.size();
}

namespace {
constexpr char MAGIC[8] = {'A', 'S', 'S', 'I', 'D', 'X', '0', '1'};

void put_u64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
void put_str(std::string& s, const std::string& v) {
    put_u64(s, v.size());
    s.append(v);
}
struct Reader {
    const std::string& s;
    size_t off = 0;
    void need(size_t n) {
        if (off + n > s.size()) throw std::invalid_argument("snapshot is truncated");
    }
    uint64_t u64() {
        need(8);
        uint64_t v;
        std::memcpy(&v, s.data() + off, 8);
        off += 8;
        return v;
    }
    std::string str() {
        uint64_t n = u64();
        need(n);
        std::string v = s.substr(off, n);
        off += n;
        return v;
    }
};
}  // namespace

std::string Index::dump() const {
    std::string s(MAGIC, 8);
    // tenants in name order, texts in age order
    std::vector<std::string> names;
    for (auto& [name, t] : tenants_) names.push_back(name);
    std::sort(names.begin(), names.end());
    put_u64(s, names.size());
    for (auto& name : names) {
        const Tenant& t = *tenants_.at(name);
        put_str(s, name);
        put_u64(s, t.serial);
        put_u64(s, t.texts.size());
        for (auto& x : t.texts) {
            s.push_back(x.history ? 'h' : 'd');
            put_str(s, x.key);
            put_u64(s, x.length);
            s.append(reinterpret_cast<const char*>(t.arena.tokens.data() + x.start), size_t(x.length) * 4);
        }
    }
    return s;
}

void Index::load(const std::string& blob) {
    if (blob.size() < 8 || std::memcmp(blob.data(), MAGIC, 8) != 0)
        throw std::invalid_argument("not a suffix index snapshot (bad magic)");
    Reader rd{blob, 8};
    std::unordered_map<std::string, std::unique_ptr<Tenant>> tenants;
    std::unordered_map<std::string, std::string> doc_tenant;
    uint64_t nt = rd.u64();
    std::vector<uint32_t> buf;
    for (uint64_t i = 0; i < nt; ++i) {
        std::string name = rd.str();
        auto t = std::make_unique<Tenant>();
        t->arena.init(p_.min_ngram, p_.max_ngram);
        t->serial = rd.u64();
        uint64_t nx = rd.u64();
        for (uint64_t j = 0; j < nx; ++j) {
            rd.need(1);
            char kind = blob[rd.off++];
            if (kind != 'h' && kind != 'd') throw std::invalid_argument("snapshot has a bad text kind");
            std::string key = rd.str();
            uint64_t len = rd.u64();
            if (len > (uint64_t(1) << 31)) throw std::invalid_argument("snapshot has a bad text length");
            rd.need(len * 4);
            buf.resize(len);
            std::memcpy(buf.data(), blob.data() + rd.off, len * 4);
            rd.off += len * 4;
            add_text(*t, kind == 'h', key, buf.data(), len);
            if (kind == 'd') doc_tenant[key] = name;
        }
        t->arena.shrink();
        tenants.emplace(name, std::move(t));
    }
    if (rd.off != blob.size()) throw std::invalid_argument("snapshot has trailing bytes");
    if (!reqs_.empty()) throw std::logic_error("load() needs an index without active requests");
    tenants_.swap(tenants);
    doc_tenant_.swap(doc_tenant);
}

}  // namespace suffix_index
