// Suffix index core: hash-chain n-gram matching over request contexts and per-tenant arenas,
// with per-request match state, drafting trees scored by continuation weights.
//
// The specification is suffix_index/reference.py; this file must produce the same candidates,
// live sets and drafts. Tokens are uint32; SEP (0xFFFFFFFF) separates texts in an arena.
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace suffix_index {

constexpr uint32_t SEP = 0xFFFFFFFFu;
constexpr int REQ = 0, ARENA = 1;
constexpr int MAX_NGRAM_LIMIT = 16;

struct Params {
    int min_ngram = 1;
    int max_ngram = 4;
    int max_candidates = 16;
    int min_candidates = 8;
    int max_agreement = 64;
    int max_branches = 16;
    int min_draft = 8;
    double min_survival = 0.01;
    double arena_weight = 1.0;
    int64_t history_tokens = int64_t(1) << 20;
    bool keep_outputs = true;
    uint32_t max_token = 0x7FFFFFFFu;   // token ids above this are refused
};

// Token storage plus hash chains. Entry id = e * K + (n - nmin) names the n-gram that ends at
// position e (its continuation starts at e), K = nmax - nmin + 1. One head table serves every n:
// head[bucket] = newest entry id + 1, prev[id] = the next older entry id + 1 in that bucket.
// Chains are walked newest first; entries of another n or another n-gram (hash collisions)
// are skipped by comparing tokens.
class ChainedText {
  public:
    void init(int nmin, int nmax);
    void push(uint32_t tok);                    // append one token and index the n-grams ending after it
    void append(const uint32_t* toks, size_t n);
    void clear();
    size_t size() const { return tokens.size(); }
    size_t nbytes() const;
    void shrink();
    // Call f(e) for end positions e (most recent first) whose last-n tokens hash like `key`.
    template <class F> void walk(const uint32_t* key, int n, F&& f) const;

    std::vector<uint32_t> tokens;

  private:
    static uint64_t hash(const uint32_t* key, int n);
    void index_at(size_t e);
    void rehash(size_t min_buckets);
    int nmin_ = 1, nmax_ = 4;
    std::vector<uint32_t> head_;    // bucket -> entry id + 1 (0 = empty)
    std::vector<uint32_t> prev_;    // entry id -> older entry id + 1 in the same bucket
    size_t entries_ = 0;
};

struct Candidate {
    int src;
    uint32_t pos;
    int agree;
};

struct TextInfo {
    bool history;
    std::string key;
    uint32_t start;
    uint32_t length;
};

struct Tenant {
    ChainedText arena;
    std::list<TextInfo> texts;                                       // insertion order = age
    std::unordered_map<std::string, std::list<TextInfo>::iterator> by_key;
    uint64_t dead = 0;
    int64_t history = 0;
    uint64_t serial = 0;
    uint64_t epoch = 0;
};

struct Request {
    Tenant* tenant;
    std::string tenant_name;
    ChainedText ctx;
    size_t prompt_len = 0;
    std::vector<Candidate> live;
    uint64_t epoch = 0;
};

struct DraftOut {
    std::vector<uint32_t> tokens;
    std::vector<int32_t> parents;
    std::vector<double> probs;
    double score = 0.0;
};

class Index {
  public:
    explicit Index(const Params& p);
    Index(const Index&) = delete;
    Index& operator=(const Index&) = delete;
    const Params& params() const { return p_; }

    void start(const std::string& req_id, const uint32_t* prompt, size_t n, const std::string& tenant);
    void extend(const std::string& req_id, const uint32_t* toks, size_t n);
    void stop(const std::string& req_id);
    bool has_request(const std::string& req_id) const { return reqs_.count(req_id) != 0; }
    std::vector<Candidate> candidates(const std::string& req_id);
    DraftOut propose(const std::string& req_id, int budget);

    void add_document(const std::string& doc_id, const uint32_t* toks, size_t n, const std::string& tenant);
    bool remove_document(const std::string& doc_id);

    size_t nbytes() const;
    size_t num_requests() const { return reqs_.size(); }
    // tokens held: request contexts, and arena tokens of live texts
    size_t request_tokens() const;
    size_t arena_tokens() const;
    int64_t history_tokens(const std::string& tenant) const;
    uint64_t arena_size(const std::string& tenant) const;

    // Snapshot of tenants' texts (history and documents), not of active requests.
    std::string dump() const;
    void load(const std::string& blob);

  private:
    Tenant& tenant(const std::string& name);
    Request& req(const std::string& req_id);
    void sync(Request& r);
    void check_tokens(const uint32_t* toks, size_t n) const;
    int agreement(const ChainedText& ctx, const std::vector<uint32_t>& text, size_t e, int n) const;
    void add_text(Tenant& t, bool history, const std::string& key, const uint32_t* toks, size_t n);
    void kill(Tenant& t, const TextInfo& x);
    void evict_history(Tenant& t);
    void maybe_compact(Tenant& t);
    void ranked_candidates(Request& r, std::vector<Candidate>& out);
    DraftOut tree(const Request& r, const std::vector<Candidate>& cands, size_t k, int budget) const;

    Params p_;
    std::unordered_map<std::string, std::unique_ptr<Tenant>> tenants_;
    std::unordered_map<std::string, std::unique_ptr<Request>> reqs_;
    std::unordered_map<std::string, std::string> doc_tenant_;
};

}  // namespace suffix_index
