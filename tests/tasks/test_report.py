"""Release report: the student-vs-teacher section shows the distillation's before/after evaluation."""
from __future__ import annotations

from tasks.report import student_table


def test_student_table_shows_agreement_kl_and_perplexity_before_and_after_training():
    s = {"student_top1_before_training": 0.052, "student_kl_before_training": 4.5, "student_ppl_before_training": 2143.7,
         "student_top1_vs_teacher": 0.233, "student_kl_vs_teacher": 1.92, "student_ppl": 137.2, "teacher_ppl": 21.2}
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in student_table(s).splitlines()[2:]}
    assert rows["before training"] == ["5.2%", "4.500", "2143.7"]
    assert rows["after training"] == ["23.3%", "1.920", "137.2"]
    assert rows["teacher"][2] == "21.2"


def test_student_table_marks_keys_an_older_cached_student_lacks():
    rows = student_table({"student_top1_vs_teacher": 0.5, "student_ppl": 10.0, "teacher_ppl": 5.0}).splitlines()
    assert rows[2] == "| before training | - | - | - |"
    assert rows[3] == "| after training | 50.0% | - | 10.0 |"
