#include "bench/report/timeline_svg.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace sg::report {

std::string timeline_svg(const parallel::pp::Timeline& t, const std::string& title) {
  const double width = 960, row = 34, left = 70, top = 40;
  const double scale = t.makespan > 0 ? (width - left - 20) / t.makespan : 1;
  const size_t ranks = t.per_rank.size();
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='" << top + row * double(ranks) + 40
    << "' font-family='sans-serif' font-size='11'>\n";
  o << "<rect width='100%' height='100%' fill='white'/>\n";
  char buf[160];
  std::snprintf(buf, sizeof buf, "%s — bubble %.1f%% of busy time", title.c_str(), 100.0 * t.bubble_fraction());
  o << "<text x='" << left << "' y='22' font-size='14'>" << buf << "</text>\n";
  for (size_t r = 0; r < ranks; ++r) {
    const double y = top + row * double(r);
    o << "<text x='8' y='" << y + row * 0.6 << "'>rank " << r << "</text>\n";
    o << "<rect x='" << left << "' y='" << y + 2 << "' width='" << t.makespan * scale << "' height='" << row - 6
      << "' fill='#f3f3f3'/>\n";
    for (const auto& a : t.per_rank[r]) {
      const bool fwd = a.action.phase == parallel::pp::Phase::forward;
      const double x = left + a.start * scale, w = std::max(1.0, (a.end - a.start) * scale);
      o << "<rect x='" << x << "' y='" << y + 2 << "' width='" << w << "' height='" << row - 6 << "' fill='"
        << (fwd ? "#9ecae1" : "#3182bd") << "' stroke='white'><title>" << (fwd ? "F" : "B") << " stage "
        << a.action.stage << " micro-batch " << a.action.micro << "</title></rect>\n";
      if (w > 14)
        o << "<text x='" << x + w / 2 << "' y='" << y + row * 0.6 << "' text-anchor='middle' fill='"
          << (fwd ? "black" : "white") << "'>" << a.action.micro << "</text>\n";
    }
  }
  const double ly = top + row * double(ranks) + 16;
  o << "<rect x='" << left << "' y='" << ly - 10 << "' width='12' height='12' fill='#9ecae1'/><text x='" << left + 16
    << "' y='" << ly << "'>forward</text>\n";
  o << "<rect x='" << left + 90 << "' y='" << ly - 10 << "' width='12' height='12' fill='#3182bd'/><text x='"
    << left + 106 << "' y='" << ly << "'>backward</text>\n";
  o << "<text x='" << left + 190 << "' y='" << ly << "'>blank: idle (the bubble)</text>\n</svg>\n";
  return o.str();
}

}  // namespace sg::report
