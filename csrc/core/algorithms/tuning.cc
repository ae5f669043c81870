#include "tuning.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <limits>

#include "../error.h"
#include "tree_topology.h"

namespace collx {

namespace {

// Dependent message steps.
double steps(Algorithm a, int n, int arity) {
  switch (a) {
    case Algorithm::kRing: return 2.0 * (n - 1);
    case Algorithm::kTree: return 2.0 * treeDepth(n, arity);
    case Algorithm::kStar: return 2.0;
    case Algorithm::kDirect: return 1.0;
    // Without hosts to go by, the hierarchical all-reduce is modelled as on
    // one host: a local reduce and broadcast, i.e. the tree's two passes.
    case Algorithm::kHierarchical: return 2.0 * treeDepth(n, arity);
    default: return 0;
  }
}

// Bytes the busiest rank sends per byte of buffer (pipelined, so depth does
// not multiply it): ring 2(n-1)/n; a tree node talks to its parent and up to
// k children; the star root to all n-1 others.
double factor(Algorithm a, int n, int arity) {
  switch (a) {
    case Algorithm::kRing: return 2.0 * (n - 1) / n;
    case Algorithm::kTree: return 1.0 + std::min(arity, n - 1);
    case Algorithm::kStar: return n - 1.0;
    case Algorithm::kDirect: return n - 1.0;
    case Algorithm::kHierarchical: return 1.0 + std::min(arity, n - 1);
    default: return 0;
  }
}

// Whitespace-separated words of `text`, without its comment lines (#).
std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  bool comment = false, lineStart = true;
  std::string w;
  for (char ch : text) {
    if (lineStart && ch == '#') comment = true;
    lineStart = ch == '\n';
    if (comment) {
      comment = !lineStart;
      continue;
    }
    if (std::isspace(static_cast<unsigned char>(ch))) {
      if (!w.empty()) out.push_back(std::move(w)), w.clear();
    } else {
      w += ch;
    }
  }
  if (!w.empty()) out.push_back(std::move(w));
  return out;
}

bool number(const std::string& w, double* v) {
  char* end = nullptr;
  *v = std::strtod(w.c_str(), &end);
  return !w.empty() && end == w.c_str() + w.size() && std::isfinite(*v);
}

std::string bytesText(size_t b) {
  if (b >= (1u << 20) && b % (1u << 20) == 0) return str(b >> 20, " MiB");
  if (b >= (1u << 10) && b % (1u << 10) == 0) return str(b >> 10, " KiB");
  return str(b, " B");
}

}  // namespace

const Tuning& Collective::costs() const { return tuning ? *tuning : Tuning::table(); }

const Tuning& Tuning::table() {
  // Fitted to benchmarks/allreduce.py on the 2-core development machine over
  // loopback TCP (n=2 and n=4; the note of the foundation issue has the runs).
  // Star and direct get half the bandwidth: the root (star) or every rank
  // (direct) reduces n-1 buffers after they arrive instead of overlapping the
  // reduction with the transfer, which on 2 cores costs as much as the copies.
  static const Tuning t{{
                            /* auto */ {0, 1},
                            /* ring */ {30.0, 1000.0},
                            /* tree */ {30.0, 1000.0},
                            /* star */ {30.0, 500.0},
                            /* direct */ {30.0, 500.0},
                            /* hier */ {30.0, 1000.0},  // without a host layout: its one-host form, see steps()
                            /* shm */ {0, 1},  // not modelled: auto takes it where it can (allreduce.cc)
                        },
                        "table"};
  static_assert(sizeof(t.cost) / sizeof(t.cost[0]) == size_t(Algorithm::kCount));
  return t;
}

Tuning Tuning::fit(int n, int arity, const std::vector<size_t>& sizes, const std::vector<std::vector<double>>& us,
                   const std::string& source) {
  Tuning t = table();
  t.source = source;
  for (size_t i = 0; i < us.size() && i < std::size(kFlatAlgorithms); ++i) {
    // Minimise sum(((A + B·s) / t - 1)^2): linear least squares in A and B
    // with the rows (1/t, s/t) and targets 1.
    double uu = 0, us1 = 0, ss = 0, u = 0, s1 = 0;
    for (size_t k = 0; k < sizes.size() && k < us[i].size(); ++k) {
      const double inv = 1.0 / std::max(us[i][k], 0.01), s = double(sizes[k]) * inv;
      uu += inv * inv, us1 += inv * s, ss += s * s, u += inv, s1 += s;
    }
    const double det = uu * ss - us1 * us1;
    double a = det > 0 ? (u * ss - s1 * us1) / det : 0, b = det > 0 ? (uu * s1 - us1 * u) / det : 0;
    const Algorithm alg = kFlatAlgorithms[i];
    // Noise that hides the slope must not make an algorithm look free at
    // large sizes: keep the table's bandwidth then.
    if (b <= 0) b = factor(alg, n, arity) / t.cost[size_t(alg)].bytesPerUs;
    a = std::max(a, 0.1);  // at least 0.1 us of latency
    t.cost[size_t(alg)] = {a / steps(alg, n, arity), factor(alg, n, arity) / b};
  }
  t.cost[size_t(Algorithm::kHierarchical)] = t.cost[size_t(Algorithm::kTree)];
  return t;
}

std::string Tuning::serialize() const {
  // snprintf, not an ostream: see append() in error.h.
  std::string out = "collx-tuning 1\n";
  for (size_t i = 1; i < size_t(Algorithm::kShm); ++i) {
    char line[96];
    std::snprintf(line, sizeof(line), "%s %.17g %.17g\n", name(Algorithm(i)), cost[i].latencyUs, cost[i].bytesPerUs);
    out += line;
  }
  return out;
}


Tuning Tuning::parse(const std::string& text, const std::string& source) {
  const std::vector<std::string> w = words(text);
  if (w.size() < 2 || w[0] != "collx-tuning" || w[1] != "1") {
    throw Error(str("collx: ", source, " is not a collx tuning file (it must start with 'collx-tuning 1')"));
  }
  Tuning t = table();
  t.source = source;
  bool seen[size_t(Algorithm::kCount)] = {};
  for (size_t i = 2; i < w.size(); i += 3) {
    const std::string& algo = w[i];
    Algorithm a = Algorithm::kAuto;
    try {
      a = parseAlgorithm(algo.c_str());
    } catch (const Error&) {
    }
    if (a == Algorithm::kAuto) throw Error(str("collx: ", source, ": unknown algorithm '", algo, "'"));
    double latency = -1, bandwidth = -1;
    if (i + 2 >= w.size() || !number(w[i + 1], &latency) || !number(w[i + 2], &bandwidth) || latency < 0 ||
        bandwidth <= 0) {
      throw Error(str("collx: ", source, ": bad constants for '", algo, "' (want a latency in us >= 0 and a "
                      "bandwidth in bytes/us > 0)"));
    }
    t.cost[size_t(a)] = {latency, bandwidth};
    seen[size_t(a)] = true;
  }
  for (Algorithm a : kFlatAlgorithms) {
    if (!seen[size_t(a)]) throw Error(str("collx: ", source, " has no line for ", name(a)));
  }
  return t;
}

std::string Tuning::describe(int n, int arity) const {
  std::string s = str("tuning from ", source, ":");
  for (Algorithm a : kFlatAlgorithms) {
    char c[96];
    std::snprintf(c, sizeof(c), " %s %.1f us/step %.0f B/us;", name(a), cost[size_t(a)].latencyUs,
                  cost[size_t(a)].bytesPerUs);
    s += c;
  }
  s += str(" auto at n=", n, ":");
  Algorithm last = Algorithm::kAuto;
  for (size_t b = 1; b <= (size_t(1) << 30); b *= 2) {
    const Algorithm a = chooseAllreduce(*this, n, arity, b);
    if (a != last) s += str(last == Algorithm::kAuto ? " " : ", ", name(a), " from ", bytesText(b));
    last = a;
  }
  return s;
}

double predictAllreduceUs(const Tuning& t, Algorithm a, int n, int arity, size_t bytes) {
  if (n <= 1) return 0;
  const AlgorithmCost& k = t.cost[size_t(a)];
  return k.latencyUs * steps(a, n, arity) + double(bytes) * factor(a, n, arity) / k.bytesPerUs;
}

Algorithm chooseAllreduce(const Tuning& t, int n, int arity, size_t bytes) {
  Algorithm best = Algorithm::kRing;
  double bestUs = std::numeric_limits<double>::infinity();
  for (Algorithm a : kFlatAlgorithms) {
    double us = predictAllreduceUs(t, a, n, arity, bytes);
    if (us < bestUs) {
      best = a;
      bestUs = us;
    }
  }
  return best;
}

Algorithm chooseAllreduce(const Tuning& t, int n, int hosts, int arity, size_t bytes) {
  if (hosts > 1 && (hosts < n || bytes >= kTwoLevelMinBytes)) return Algorithm::kHierarchical;
  return chooseAllreduce(t, n, arity, bytes);
}

int chooseTreeArity(const Tuning& t, int n, int arity, size_t bytes) {
  // One pipelined pass: depth(k) steps; the busiest node sends k copies.
  // Candidates: direct (k = n-1), the configured arity, and a chain (k = 1).
  // A step costs at least kMinStepUs: a fit whose latency came out near its
  // 0.1 us floor (the large sizes outweighing the small ones) would
  // otherwise send a few hundred bytes down a chain, one wakeup per hop.
  constexpr double kMinStepUs = 1.0;
  const AlgorithmCost& k = t.cost[size_t(Algorithm::kTree)];
  const double step = std::max(k.latencyUs, kMinStepUs);
  auto us = [&](int a) { return step * treeDepth(n, a) + double(bytes) * std::min(a, n - 1) / k.bytesPerUs; };
  int best = std::max(1, n - 1);
  for (int a : {arity, 1}) {
    if (us(a) < us(best)) best = a;
  }
  return best;
}

bool reduceByRing(int n, size_t bytes) {
  // Every tree rank reduces the whole buffer; the ring splits that work n
  // ways, which wins once the buffer is large.
  constexpr size_t kRingMinBytes = 1 << 20;
  return n >= 3 && bytes >= kRingMinBytes;
}

bool allgatherDirect(int n, size_t blockBytes) {
  // Both send (n-1) blocks per rank; the ring pays n-1 dependent steps, the
  // direct exchange one step but n-1 concurrent streams into every rank,
  // which stops paying once the blocks are large.
  constexpr size_t kDirectMaxBlockBytes = 256 << 10;
  return n <= 2 || blockBytes <= kDirectMaxBlockBytes;
}

}  // namespace collx
