// Auto's cost model fitted to this group's links, at the group's creation.
//
//   1. Agree on a tuning every rank already has: each rank hashes its cached
//      (or COLLX_TUNING file's) text, and one all-reduce of {hash, -hash}
//      with MAX tells every rank whether all hashes are equal. If they are,
//      that tuning is used and nothing is timed.
//   2. Otherwise calibrate: at each size of kCalibrationSizes, a few rounds
//      of each flat algorithm, each timed op after an untimed one of its
//      algorithm; each rank keeps the fastest round (load only adds time).
//      One all-reduce with MAX gives every rank the same
//      table (the slowest rank's view), so every rank fits the same
//      constants and auto picks the same algorithm everywhere.
//   3. Fit, per algorithm, time = A + B·bytes (least squares on relative
//      error); latency = A / steps, bandwidth = factor / B (tuning.h).
//   4. Write the result to the cache file (atomically: a temporary, then a
//      rename), for later groups and runs with the same key.
//
// Beside the cache file, under the same key, the choices online refinement
// settled on (refine.h) are saved (saveRefined). Step 1 agrees on them as on
// the tuning, in the same all-reduce: a group seeds them only where every
// rank read the same. They are measured, not fitted, so they outlive a
// recalibration; the group checks them before it trusts them.
//
// The calibration's messages are kCalibrate frames with sequence numbers of
// their own, so they never meet the group's ops.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "collective.h"
#include "tuning.h"

namespace collx {

struct TuningPolicy {
  enum class Mode { kTable, kCalibrate, kFile } mode = Mode::kCalibrate;
  std::string file;       // kFile: the tuning file
  std::string cacheDir;   // kCalibrate: where cached tunings live ("" = no cache)
  std::string cacheKey;   // kCalibrate: what the cache is for (hosts, ranks, settings)
};

// What tuneGroup did, for the log.
struct TuningOutcome {
  Tuning tuning = Tuning::table();
  double calibrationMs = 0;   // 0 when nothing was timed
  std::string cacheWarning;   // non-empty when the cache could not be written
  std::string cachePath;      // kCalibrate: the cache file read or written ("" = none)
  std::string refinedPath;    // where refined choices are saved, beside the cache ("" = none)
  std::string refined;        // the saved choices every rank read (Refiner::seed's text), or ""
};

// Reads and parses a kFile policy's file into `text` (if given); throws
// Error where it cannot. tuneGroup's reading, and a check at a creation
// that returns before the group tunes.
Tuning loadTuningFile(const TuningPolicy& policy, std::string* text = nullptr);

// Steps 1 to 4 above. Every rank must call it, with the same policy mode, as
// the group's first collective. Throws Error on a failed peer, a timeout, or
// a tuning file that is unreadable or differs between ranks.
TuningOutcome tuneGroup(const Collective& c, const TuningPolicy& policy);

// Saves refined choices beside `out`'s cache: `text` gets the choices saved
// there before (else "") and returns the new ones
// (Refiner::save). Returns why it could not, or "".
std::string saveRefined(const TuningOutcome& out, const std::function<std::string(const std::string&)>& text);

}  // namespace collx
