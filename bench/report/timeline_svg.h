// A pipeline timeline as an SVG picture: one row per rank, one box per action (forward light,
// backward dark, labelled with the micro-batch), idle time left blank — the bubble one can see.
#pragma once
#include <string>

#include "parallel/pp/schedule.h"

namespace sg::report {

std::string timeline_svg(const parallel::pp::Timeline& t, const std::string& title);

}  // namespace sg::report
