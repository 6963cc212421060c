"""PII and secret scrubbing for chat traffic: the one owner of what gets replaced, and how.

    python -m edgeflow.pii "Ruf mich an: 0151 12345678, IBAN DE89 3704 0044 0532 0130 00, mail jane@example.com"

The edge server scrubs every access-log record with `scrub_value` before writing it; ingestion
(`edgeflow.calibration.access_logs.ingest`) scrubs again with `scrub`, because logs written by older servers are raw.
Measured recall, false positives and speed: `python benchmarks/pii.py` (fixture: data/pii/planted.jsonl).

Covered, in the order applied (an earlier kind claims its characters first, so the digits of a card or an
IBAN are never re-read as a phone number):

  kind(s)                         placeholder     a candidate is replaced when
  jwt, bearer                     [TOKEN]         eyJ….….… (optionally after "Bearer"); "Bearer <20+ chars>"
  api_key, github_token, aws_key  [API_KEY]       sk-/pk-/rk- keys; gh[pousr]_ tokens; AKIA… access key ids
  email                           [EMAIL]         local@domain.tld
  iban                            [IBAN]          python-stdnum `iban` accepts it (country format + mod 97)
  cn_ric fr_nir kr_rrn ch_ssn     [NATIONAL_ID]   long IDs with a birth date and/or check digits, before cards
  card                            [CARD]          13-19 digits, a card issuer's prefix, Luhn check
  other national IDs (below)      [NATIONAL_ID]   a regex finds the shape, the python-stdnum validator accepts it
  phone                           [PHONE]         libphonenumber `PhoneNumberMatcher(text, region, Leniency.VALID)`
                                                  for each region of COVERED_REGIONS, on windows of >= 7 digits

  National IDs by region (python-stdnum module; "label" = only next to a word naming the ID):
    US ssn (us.ssn; 9 digits without dashes: label)
    GB uk_nino (prefix rules; the NINO has no check digit), gb_nhs (gb.nhs; label)
    DE de_idnr (de.idnr, Steuer-ID; 11 bare digits: label)    FR fr_nir (fr.nir)
    ES es_dni, es_nie (es.dni, es.nie)    IT it_cf (it.codicefiscale)    NL nl_bsn (nl.bsn; label)
    SE se_personnummer (se.personnummer; without "-": label)    PL pl_pesel (pl.pesel; label)
    BE be_nn (be.nn; 11 bare digits: label)    CH ch_ssn (ch.ssn, AHV 756…)    FI fi_hetu (fi.hetu)
    CN cn_ric (cn.ric, 18 characters)    JP jp_my_number (jp.in_; label)    KR kr_rrn (kr.rrn; without "-": label)
    TW tw_id (letter + 9 digits; python-stdnum has no module, the published checksum is implemented here)
    IN in_aadhaar (in_.aadhaar, Verhoeff; 12 bare digits: label), in_pan (in_.pan)    BR br_cpf (br.cpf)
  "Label" applies where one check digit on 9-12 bare digits would accept ~10% of random numbers, and to
  bare BE numbers (11 digits, like the mobile numbers of CN, KR and BR). Candidates with a label near are
  decided first, so "Steuer-ID 12345678901" is judged as a Steuer-ID even when another 11-digit check
  (CPF, PESEL, BE national number) happens to pass.

  Fail closed: a validator that raises counts as a hit, and a phone matcher that raises masks its whole digit window; a candidate whose check fails is still replaced when
  a word naming its kind stands near it (a mistyped ID is still somebody's), and so is an IBAN-shaped string
  that fails its check; a number of plausible length right after a word naming it a phone number or an ID,
  in the fleet's languages ("我的手机号是…", "my ID number is …"), is replaced whatever libphonenumber or a
  checksum says of it (kinds labelled_phone, labelled_id).

  Candidates that keep their digits: a number whose check fails with no word naming it; a number right after
  "order", "invoice", "Bestellnummer", "注文番号", … (a reference number); digits written without "+", separators or a leading 0 that a unit or currency follows or
  precedes ("48213907 rows", "21893095人", "$1299000"), unless a word such as "call", "Handy", "电话",
  "전화" is near; a leading calendar date; digits next to "=", "×", "*", … (arithmetic).

Not covered: names, postal addresses, dates of birth on their own, passwords without a known prefix, phone
numbers of regions outside COVERED_REGIONS written in national format, numbers with fewer than 7 digits,
Korean RRNs issued since October 2020 (random digits, no check digit: only old-checksum ones are caught).

Matching runs on a folded copy of the text of the same length (full-width ASCII and other Unicode digits,
dashes and spaces mapped to ASCII), so "０９０－１２３４－５６７８" is found like "090-1234-5678" and
each replacement lands on the original characters.

The package: detectors.py (what is looked for), phones.py (phone numbers), labels.py (the decisions around a
candidate), scrubber.py (the policy), api.py (the module-level calls re-exported here).
"""
from edgeflow.pii.api import find, merge_counts, scrub, scrub_value
from edgeflow.pii.detectors import (COVERED_REGIONS, DETECTORS, KINDS, PHONE_KIND, PHONE_LENIENCY, PHONE_MIN_DIGITS,
                                    PLACEHOLDERS, Detector, Finding)
from edgeflow.pii.scrubber import Scrubber

__all__ = ["COVERED_REGIONS", "DETECTORS", "KINDS", "PHONE_KIND", "PHONE_LENIENCY", "PHONE_MIN_DIGITS", "PLACEHOLDERS",
           "Detector", "Finding", "Scrubber", "find", "merge_counts", "scrub", "scrub_value"]
