// Saved choices (refine.h): a settled class's line, and the seed that
// starts a later group's class at the check of that choice.
#include <set>
#include <sstream>
#include <string>

#include "../error.h"
#include "refine.h"

namespace collx {

void Refiner::apply(const Seed& s, Class& k) {
  int kept = -1;
  for (int i = 0; i < k.count; ++i) {
    for (const auto& [a, us] : s.us) {
      if (a == k.candidate[i]) k.agreedUs[i] = k.trialUs[i] = us;
    }
    if (k.candidate[i] == s.kept && k.agreedUs[i] > 0) kept = i;
  }
  if (kept < 0) {  // saved under other candidates: a trial, as if none was saved
    std::fill(std::begin(k.agreedUs), std::end(k.agreedUs), 0.0);
    std::fill(std::begin(k.trialUs), std::end(k.trialUs), 0.0);
    return;
  }
  k.kept = kept;
  k.checkOps = checkOpsFor(k.agreedUs[kept]);
  k.seeded = true;
  k.doubted = s.doubted;  // a doubted choice still gets its second trial
  k.second = !s.doubted;
}

std::string Refiner::save(const std::string& previous) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  std::set<std::string> mine;
  for (const auto& [key, k] : classes_) {
    if (k.count < 2 || k.kept < 0 || k.checkOps > 0) continue;
    std::string line = str(key.first, key.second ? " one" : " flat");
    mine.insert(line);
    line += str(" ", name(k.candidate[k.kept]), " ", int(k.doubted));
    char us[48];
    for (int i = 0; i < k.count; ++i) {
      if (k.agreedUs[i] <= 0) continue;
      std::snprintf(us, sizeof us, " %s=%.3f", name(k.candidate[i]), k.agreedUs[i]);
      line += us;
    }
    out += line + "\n";
  }
  std::istringstream in(previous);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    std::string bytes, kind;
    if (words >> bytes >> kind && !mine.count(bytes + " " + kind)) out += line + "\n";
  }
  return out;
}

void Refiner::seed(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::istringstream words(line);
    size_t bytes = 0;
    std::string kind, kept, pair;
    int doubted = 0;
    if (!(words >> bytes >> kind >> kept >> doubted) || bytes == 0 || (kind != "one" && kind != "flat")) continue;
    try {
      Seed s{parseAlgorithm(kept.c_str()), doubted != 0, {}};
      while (words >> pair) {
        const size_t eq = pair.find('=');
        if (eq == std::string::npos) throw Error("no '='");
        const double us = std::stod(pair.substr(eq + 1));
        if (!(us > 0 && us < 1e12)) throw Error("not a time");
        s.us.emplace_back(parseAlgorithm(pair.substr(0, eq).c_str()), us);
      }
      seeds_[{bytes, kind == "one"}] = std::move(s);
    } catch (const std::exception&) {  // a damaged line: that class runs its trial
    }
  }
}

}  // namespace collx
