// suffix_index._core: the native part of suffix_index, built by CMakeLists.txt (repo root)
// with nanobind through scikit-build-core. Every suffix_index/csrc/*.cpp is compiled into this
// one module. Validation of user input happens in suffix_index/index.py; this layer only checks
// what would otherwise be undefined behaviour, and raises ValueError / KeyError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "index.hpp"

namespace nb = nanobind;
using namespace suffix_index;

// Bump when the Python-visible interface of _core changes incompatibly.
static constexpr int kAbiVersion = 3;

using Tokens = nb::ndarray<const uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

static nb::tuple draft_tuple(const DraftOut& d) {
    nb::list toks, parents, probs;
    for (size_t i = 0; i < d.tokens.size(); ++i) {
        toks.append(int(d.tokens[i]));
        parents.append(int(d.parents[i]));
        probs.append(d.probs[i]);
    }
    return nb::make_tuple(toks, parents, probs, d.score);
}

NB_MODULE(_core, m) {
    m.doc() = "suffix_index native core";
    m.def("abi_version", []() { return kAbiVersion; }, "Version of the _core interface (int).");
    m.attr("SEP") = SEP;

    nb::class_<Params>(m, "Params")
        .def(nb::init<>())
        .def_rw("min_ngram", &Params::min_ngram)
        .def_rw("max_ngram", &Params::max_ngram)
        .def_rw("max_candidates", &Params::max_candidates)
        .def_rw("min_candidates", &Params::min_candidates)
        .def_rw("max_agreement", &Params::max_agreement)
        .def_rw("max_branches", &Params::max_branches)
        .def_rw("min_draft", &Params::min_draft)
        .def_rw("min_survival", &Params::min_survival)
        .def_rw("arena_weight", &Params::arena_weight)
        .def_rw("history_tokens", &Params::history_tokens)
        .def_rw("keep_outputs", &Params::keep_outputs)
        .def_rw("max_token", &Params::max_token);

    nb::class_<Index>(m, "Index")
        .def(nb::init<const Params&>())
        .def("start",
             [](Index& ix, const std::string& req_id, Tokens prompt, const std::string& tenant) {
                 ix.start(req_id, prompt.data(), prompt.shape(0), tenant);
             })
        .def("start",
             [](Index& ix, const std::string& req_id, const std::vector<uint32_t>& prompt, const std::string& tenant) {
                 ix.start(req_id, prompt.data(), prompt.size(), tenant);
             })
        .def("extend",
             [](Index& ix, const std::string& req_id, Tokens toks) { ix.extend(req_id, toks.data(), toks.shape(0)); })
        .def("extend",
             [](Index& ix, const std::string& req_id, const std::vector<uint32_t>& toks) {
                 ix.extend(req_id, toks.data(), toks.size());
             })
        .def("stop", &Index::stop)
        .def("has_request", &Index::has_request)
        .def("propose",
             [](Index& ix, const std::string& req_id, int budget) { return draft_tuple(ix.propose(req_id, budget)); })
        .def("candidates",
             [](Index& ix, const std::string& req_id) {
                 std::vector<std::tuple<int, uint32_t, int>> out;
                 for (auto& c : ix.candidates(req_id)) out.emplace_back(c.src, c.pos, c.agree);
                 return out;
             })
        .def("add_document",
             [](Index& ix, const std::string& doc_id, Tokens toks, const std::string& tenant) {
                 ix.add_document(doc_id, toks.data(), toks.shape(0), tenant);
             })
        .def("add_document",
             [](Index& ix, const std::string& doc_id, const std::vector<uint32_t>& toks, const std::string& tenant) {
                 ix.add_document(doc_id, toks.data(), toks.size(), tenant);
             })
        .def("remove_document", &Index::remove_document)
        .def_prop_ro("nbytes", &Index::nbytes)
        .def_prop_ro("num_requests", &Index::num_requests)
        .def_prop_ro("request_tokens", &Index::request_tokens)
        .def_prop_ro("arena_tokens", &Index::arena_tokens)
        .def("history_tokens", &Index::history_tokens)
        .def("arena_size", &Index::arena_size)
        .def("dump", [](const Index& ix) {
            std::string s = ix.dump();
            return nb::bytes(s.data(), s.size());
        })
        .def("load", [](Index& ix, nb::bytes blob) { ix.load(std::string(blob.c_str(), blob.size())); });
}
